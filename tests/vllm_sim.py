"""A paged-attention engine in plain torch around a transformers model, driving ``restkv.vllm``'s
worker as the vLLM plugin's hooks do (no vLLM needed).

Its scheduler applies ``restkv.vllm.settings``' rules (blocks allocated for the held entries, the
fresh ones of a first eviction under prefix caching, the hit limit, the blocks given back); its
attention writes each step's keys and values into a paged cache of the chosen layout
(``restkv.vllm.paged``), attends over the entries the request holds and calls ``Worker.layer``. So a
test can put restkv's vLLM path beside ``restkv.configure`` on the same model, prompt and knobs.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.modeling_utils import AttentionInterface

from restkv.config import CompressionConfig
from restkv.vllm import memory, paged, per_request, settings
from restkv.vllm.heads import Space
from restkv.vllm.worker import Worker

_ENGINES: list = [None]  # the engine whose forward is running (read by the attention function)


def _paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    out = _ENGINES[0].attend(module, query, key, value, scaling or module.head_dim**-0.5)
    return out, None


AttentionInterface.register("restkv_paged_sim", _paged_attention)


def scrambled_writer(cache, keys, values, slots):
    """A cache writer whose block layout is not strided: each block's keys and values are stored
    in a fixed random order of its elements (as a packed ISA layout would be)."""
    _, heads, block_size, width = cache.shape
    d = width // 2
    size = block_size * heads * d
    order = torch.randperm(2 * size, generator=torch.Generator().manual_seed(7))
    for slot, k, v in zip(slots.tolist(), keys, values):
        block, offset = divmod(slot, block_size)
        flat = cache[block].view(-1)
        inner = torch.arange(heads * d).view(heads, d) + offset * heads * d
        flat[order[inner]] = k
        flat[order[inner + size]] = v


class Failed(RuntimeError):
    """A request whose eviction failed on the worker (``Worker.report``): vLLM's scheduler finishes it."""


class PagedEngine:
    """One request at a time, greedy; ``chunk``: prefill tokens per step (None: the whole prompt)."""

    def __init__(
        self,
        model,
        knobs: dict,
        block_size=8,
        num_blocks=256,
        chunk=None,
        caching=False,
        layout="declared",
    ):
        cfg = model.config
        self.model = model
        self.cfg = CompressionConfig.from_kwargs(**knobs)
        settings.check(self.cfg)
        settings.bind_model(self.cfg, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.bs = block_size
        self.chunk = chunk
        self.caching = caching
        hkv, d = cfg.num_key_value_heads, cfg.head_dim
        # every layer in one allocation, layer after layer, as vLLM holds them
        self.caches = list(torch.zeros(cfg.num_hidden_layers, num_blocks, hkv, block_size, 2 * d, dtype=model.dtype))
        if layout == "declared":
            def view(c):
                return paged.declared(c, "SIM", hkv, d, block_size, model.dtype)
        else:
            def view(c):
                return paged.probed(c, block_size, hkv, d, scrambled_writer, "scrambled")
        self.paged = [view(c) for c in self.caches]
        self.free = list(range(num_blocks))
        model_sizes = memory.Model(
            cfg.num_hidden_layers, cfg.num_attention_heads, hkv, d, cfg.hidden_size, model.dtype.itemsize
        )
        self.engine = per_request.Engine(self.cfg, model_sizes, 4, 4096, 4096, block_size)
        self.worker = Worker(self.cfg, slots=4, caching=caching, block_size=block_size, engine=self.engine)
        self.recorded: dict = {}  # request id -> {layer name: its first kept positions [Hkv, B]}
        self.worker.observer = lambda req, layer, p: self.recorded.setdefault(req, {}).update({layer: p})
        layers = model.model.layers
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(len(layers))]
        self.worker.index_layers(
            {
                n: (lambda a=layer.self_attn: a.o_proj.weight.detach())
                for n, layer in zip(self.names, layers)
            }
        )
        self.released = []  # blocks given back by first evictions under prefix caching: (block ids, contents)
        # per step of a request whose heads hold their own pages: (its blocks, the entries the scheduler counts,
        # its heads' lengths [layers, Hkv], whether it evicted); every page a head holds is checked to be in the
        # request's blocks
        self.pages_trace = []
        scale = cfg.head_dim**-0.5
        tensor, first = paged.whole(dict(zip(self.names, self.caches)))
        self.worker.space, self.worker.whole = Space(first, hkv), view(tensor)
        self.worker.attends = {n: single_head_attention(self.worker.whole, scale) for n in self.names}

    def generate(self, ids: list[int], new_tokens: int, hit_blocks: list[int] = (), knobs=None) -> list[int]:
        """Greedy tokens after ``ids``; ``hit_blocks``: blocks holding the prompt's first tokens (a
        prefix-cache hit, capped by ``settings.hit_limit``); ``knobs``: the request's own
        (``restkv.vllm.per_request``; None: the engine's)."""
        req = "r"
        cfg = per_request.resolve(self.engine, knobs)
        self.worker.admit(req, None if knobs is None else {per_request.KEY: knobs})
        limit = len(ids) if cfg is None else settings.hit_limit(cfg, len(ids))
        hit = min(len(hit_blocks) * self.bs, limit) // self.bs
        self.blocks = list(hit_blocks[:hit])
        computed, offset, evicted, seq, out = hit * self.bs, 0, False, list(ids), []
        try:
            while len(out) < new_tokens:
                prompt_left = len(ids) - computed
                n = prompt_left if prompt_left > 0 else 1
                if prompt_left > 0 and self.chunk:
                    n = min(n, self.chunk)
                e = None if cfg is None else settings.eviction(
                    cfg, computed, n, len(ids), offset, self.caching, self.bs, evicted
                )
                slots = computed + n - offset if e is None else max(computed + n - offset, e.slots)
                while len(self.blocks) * self.bs < slots:
                    self.blocks.append(self.free.pop(0))
                self.step = (computed, n, offset)
                self.worker.blocks[req] = list(self.blocks)
                self.worker.begin([req], [computed], [n], [len(ids)], "cpu")
                logits = self.forward(seq[computed : computed + n], computed)
                self.worker.end()
                rule = e
                e = self.worker.cut(req)  # a deferred count as the worker measured it (``Worker.report``)
                self._check(req, rule, e)
                if e is not None:
                    gone = e.cut(self.blocks)
                    if e.fresh:
                        self.released.append((gone, [c[gone].clone() for c in self.caches]))
                    self.free += [b for b in gone if b not in hit_blocks]
                    offset += e.evicted
                    evicted = True
                self._trace_pages(req, e, computed + n - offset)
                computed += n
                if computed >= len(ids):
                    token = int(logits.argmax())
                    out.append(token)
                    seq.append(token)
        finally:  # finished, or failed (``Failed``): vLLM's scheduler tells the worker
            self.worker.forget([req])
            self.worker.finish([req])
        return out

    def _check(self, req, rule, e) -> None:
        """As vLLM's scheduler checks the worker's report of a step (``restkv.vllm.hooks.scheduler``): a
        failed request stops here (``Failed``); an eviction the rule gives is reported with its entries
        held, the count it is cut to and a count of dropped positions never below 0; no other."""
        report = self.worker.report()
        if req in report.failed:
            raise Failed(report.failed[req])
        kept = report.kept.get(req)
        assert (kept is None) == (rule is None), (kept, rule)
        if kept is not None:
            assert (kept.held, kept.counted) == (rule.held, e.counted), (kept, e)
            assert kept.dropped >= 0 and kept.heads == len(self.names) * self.model.config.num_key_value_heads

    def _trace_pages(self, req, e, counted: int) -> None:
        state = self.worker.requests.get(req)
        if state is None or not state.pages:
            return
        inside = set(self.worker.space.pages(self.blocks))
        held = [p for pages in state.pages.values() for row in pages.rows for p in row]
        assert set(held) <= inside, f"pages {sorted(set(held) - inside)} outside the request's blocks"
        assert len(held) == len(set(held)), "a page held twice"
        lengths = np.stack([pages.lengths for pages in state.pages.values()])
        self.pages_trace.append((len(self.blocks), counted, lengths, e is not None))

    @torch.no_grad()
    def forward(self, tokens: list[int], first: int):
        _ENGINES[0] = self
        try:
            ids = torch.tensor([tokens])
            positions = torch.arange(first, first + len(tokens))[None]
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False)
        finally:
            _ENGINES[0] = None
        return out.logits[0, -1]

    def attend(self, module, query, key, value, scale):
        """The step's queries [1, Hq, n, d] over the entries the request holds, its own keys and
        values [1, Hkv, n, d] written first; then the worker's eviction for the layer. A request
        whose heads hold their own pages (per-head budgets, once evicted) is written and attended by
        the worker (``Worker.attend_heads``, through ``single_head_attention``)."""
        computed, n, offset = self.step
        layer = module.layer_idx
        cache = self.paged[layer]
        q, k_step, v_step = (x[0].transpose(0, 1) for x in (query, key, value))  # [n, H, d]
        if self.worker.flat_tokens is not None:
            out = torch.zeros_like(q)
            self.worker.layer(self.names[layer], q, cache, scale, None, k_step, v_step, out)
            return out[None]
        held_before = computed - offset
        j = torch.arange(held_before, held_before + n)
        slots = torch.tensor(self.blocks)[j // self.bs] * self.bs + j % self.bs
        cache.write(slots, k_step, v_step)
        held = torch.arange(held_before + n)
        k, v = cache.read(torch.tensor(self.blocks)[held // self.bs] * self.bs + held % self.bs)
        g = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(g, 1)
        v = v.float().repeat_interleave(g, 1)
        logits = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
        visible = held[None, :] <= (held_before + torch.arange(n))[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v).to(query.dtype)
        self.worker.layer(self.names[layer], q, cache, scale, None)
        return out[None]


def single_head_attention(cache, scale: float):
    """Attention over single-head pages (``restkv.vllm.heads``) in plain torch, as the hooks' one
    through a backend: ``attend(query [Hkv T, G, d], batch, kv_cache, keys, values) -> [Hkv T, G, d]``, each
    sequence's i-th of c queries seeing all but the last c - 1 - i of its entries, once the step's ``keys``,
    ``values`` are written at the batch's slots."""

    def attend(query, batch, kv_cache, keys, values):
        cache.write_pages(batch.slot_mapping, keys, values)
        out = torch.empty_like(query)
        bs = cache.block_size
        for i, n in enumerate(batch.seq_lens.tolist()):
            a, b = batch.query_start_loc[i].item(), batch.query_start_loc[i + 1].item()
            j = torch.arange(n)
            k, v = cache.read_pages(batch.block_table[i].long()[j // bs] * bs + j % bs)
            logits = torch.einsum("tgd,nd->tgn", query[a:b].float(), k.float()) * scale
            visible = j[None, :] <= (n - (b - a) + torch.arange(b - a))[:, None]
            logits = logits.masked_fill(~visible[:, None], float("-inf"))
            out[a:b] = torch.einsum("tgn,nd->tgd", logits.softmax(-1), v.float()).to(query.dtype)
        return out

    return attend
