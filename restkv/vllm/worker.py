"""A worker's eviction state and its steps (no vLLM import: ``restkv.vllm.hooks`` feeds it vLLM's
tensors and block tables).

Each engine step the model runner describes its batch (``Worker.begin``): per request its tokens in
the step, the tokens computed before, its prompt length and its blocks; a new request's config comes
with it (``admit``: its own knobs over the engine's, ``restkv.vllm.per_request``), and each request is
scored, kept and counted by its own. The rule of
``restkv.vllm.settings.eviction`` says which requests evict at the end of the step. Then every
attention layer, after its attention, calls ``Worker.layer``: the step's queries go to the query
ring; a ``SUMMED`` method's prompt chunk adds its scores; each evicting request reads the entries it
holds back from the layer's paged cache (``restkv.vllm.paged``), selects, and writes the kept
entries to the blocks the rule names. ``Worker.end`` records the new offsets and returns the
block-table edits for the next step.

Per-head and per-layer budgets (``settings.per_head``): an eviction places each head's kept entries on
single-head pages of its own (``restkv.vllm.heads``); from the next step on, the request's tokens are
written to its heads' pages and attended through the layer's backend over the flattened batch
(``attend_heads``), vLLM's own write masked and its output for them replaced; an eviction while decoding
reads them back laid out as ``restkv.configure`` lays out heads of different lengths (``HeadPages.layout``).
A budget shared across layers (``settings.deferred``): each layer leaves its scores, and ``end`` selects
once every layer has run, its kept count sent to the scheduler with the step's output (``report``).

Memory (``restkv.vllm.memory`` counts it, term by term): per layer, the ring's ``query_rows`` queries
[rows, Hq, d] for every request slot, allocated on the layer's first step; during an eviction the
entries the request holds, read back once (one copy of its K+V) plus the selection's own; a
``SUMMED`` method's prefill [Hq, L] float32 scores per request.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..scoring.observe import wo_factor
from . import per_request, settings
from .memory import reads_factor
from .outcome import Kept, Outcome, merged, why
from .heads import FlatBatch, HeadPages, exact_length, flat_rows, flatten, settle, stage, unflatten
from ..strategies.budgets import shared_sizes
from .ranks import layer_sizes, layers_sizes
from .scoring import chunk_score, entry_scores, kept_entries, observation, slot_rows

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass
class RequestState:
    """One request's state on a worker."""

    slot: int  # its row in the query ring
    cfg: object  # the config it runs (``per_request``; None: it keeps all)
    offset: int = 0  # entries evicted so far (logical - held)
    evicted: bool = False  # it evicted before (``settings.eviction``'s ``evicted``)
    sums: dict = field(default_factory=dict)  # layer name -> [Hq or Hkv, n] summed chunk scores
    pages: dict = field(default_factory=dict)  # layer name -> its heads' pages (per-head budgets, once evicted)
    free: list = field(default_factory=list)  # pages of its blocks no head of any layer holds (shared by ``pages``)
    placed: int = 0  # its blocks whose pages ``pages`` and ``free`` hold


@dataclass
class Scheduled:
    """One request's part of a step."""

    req_id: str
    state: RequestState
    start: int  # its first token in the step's batch
    count: int  # its tokens in the step
    computed: int  # tokens computed before the step (logical)
    prompt_len: int
    blocks: np.ndarray  # its block ids
    eviction: settings.Eviction | None
    sums: bool  # its prefill adds a SUMMED method's chunk scores
    held_slots: torch.Tensor | None = (
        None  # [held] the slots of the entries it holds, on the device
    )
    kept_slots: torch.Tensor | None = None  # [budget] where its kept entries go
    scores: dict = field(default_factory=dict)  # layer name -> [1, Hkv, P] its selection scores (deferred)
    kept_pages: list = field(default_factory=list)  # per-head budgets: every page of the blocks it keeps
    dropped: int = 0  # positions its eviction dropped so far in the step, over its layers and KV heads
    heads: int = 0  # the (layer, KV head) pairs ``dropped`` sums over

    @property
    def end(self) -> int:
        return self.computed + self.count

    @property
    def cfg(self):
        return self.state.cfg


class QueryRing:
    """The most recent queries of every request, per layer: [slots, rows, Hq, d], the query of
    position p in row ``p % rows`` (allocated on a layer's first step, on its queries' device, for
    all ``slots`` at once: its size is known before any request, ``restkv.vllm.memory``)."""

    def __init__(self, rows: int, slots: int = 1):
        self.rows = rows
        self.slots = slots
        self.buffers: dict = {}

    def write(self, layer: str, query: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor) -> None:
        """query [T, Hq, d]: the step's; ``tokens`` [m] which of them, ``index`` [m] their rows."""
        buffer = self.buffers.get(layer)
        if buffer is None or buffer.shape[0] < self.slots * self.rows:
            grown = query.new_zeros(self.slots * self.rows, *query.shape[1:])
            if buffer is not None:
                grown[: buffer.shape[0]] = buffer
            buffer = self.buffers[layer] = grown
        buffer.index_copy_(0, index, query.index_select(0, tokens))

    def read(self, layer: str, slot: int, end: int, count: int) -> torch.Tensor:
        """The queries of positions ``end - count`` .. ``end - 1`` of the request in ``slot`` ->
        [count, Hq, d], oldest first."""
        buffer = self.buffers[layer]
        rows = torch.arange(end - count, end, device=buffer.device) % self.rows + slot * self.rows
        return buffer.index_select(0, rows)


class Worker:
    """One model runner's eviction state (``cfg`` the engine's config, ``slots`` its most
    requests at once, ``caching`` vLLM's prefix caching, ``block_size`` its blocks' tokens,
    ``engine`` what a request's own knobs resolve against: ``per_request``)."""

    def __init__(self, cfg, slots: int, caching: bool, block_size: int, engine=None):
        self.cfg = cfg
        self.engine = engine
        self.tensor_parallel = 1 if engine is None else engine.tensor_parallel  # ranks, each with some heads
        self.ranks = None  # ``ranks.Ranks``: their collectives, under tensor parallelism (set by the hooks)
        self.configs: dict = {}  # request id -> the config it runs (``admit``), until it finishes
        self.caching = caching
        self.block_size = block_size
        self.ring = QueryRing(settings.query_rows(cfg), slots)
        self.free_slots = list(range(slots - 1, -1, -1))
        self.requests: dict = {}  # request id -> RequestState
        self.step: list = []  # Scheduled, this step's
        self.ring_tokens = self.ring_index = None
        # the step's offsets (logical - held, as the backend's kernel reads them): per request on the host,
        # per token and per request on the device
        self.request_offsets = np.zeros(0, dtype=np.int64)
        self.token_offsets_device = self.request_offsets_device = None
        self.o_proj: dict = {}  # attention layer name -> a function returning its W_O [hidden, Hq d]
        self.factors: dict = {}  # attention layer name -> its W_O factor R [Hq, d, d]
        self.rank: dict = {}  # attention layer name -> its index among the model's attention layers
        self.layers = 1  # the model's attention layers (a pipeline stage holds some: ``index_layers``)
        self.relayed = None  # the earlier pipeline stages' outcome of the step (``outcome.KEY``), or None
        # called with (request id, layer name, kept positions [Hkv, B]) at a request's first eviction in a
        # layer, where a check installs one (benchmarks/vllm_check.py); None: nothing is kept
        self.observer = None
        self.blocks: dict = {}  # request id -> its block ids (the scheduler's, as the steps give them)
        self.pending: dict = {}  # request id -> its last step's Eviction: its blocks to cut before the next step
        self.held_lengths = None  # the step's sequence lengths of the entries held, where a runner needs them
        self.backends: dict = {}  # attention layer name -> its backend's name (for errors)
        self.done: set = set()  # the layers whose attention called ``layer`` in this step
        # per-head budgets (``restkv.vllm.heads``): attention layer name -> a function attending a
        # ``FlatBatch`` through the layer's backend (set by the hooks); the step's flattened batch per
        # layer, and its tokens [m] on the device (those of the requests whose heads hold their own pages)
        self.attends: dict = {}
        self.space = None  # ``heads.Space``: where every layer's pages are in ``whole``
        self.whole = None  # ``paged.Paged`` of every layer's cache as one tensor of blocks (``paged.whole``)
        self.flat: dict = {}
        self.flat_index: dict = {}  # layer name -> where its flattened keys and values go (``Paged.page_index``)
        self.flat_tokens = None
        self.flat_rows: tuple = ()  # [Hkv m] each: every flattened row's token and KV head (``_flatten``)
        # ``settings.deferred``: the step's layers to select in once all have run (name -> (paged, scale,
        # softcap))
        self.later: dict = {}
        # the step's evictions as they ran (``restkv.vllm.outcome``): request id -> why its eviction failed
        # (the request is skipped from there on), and a failure that is not one request's
        self.failed: dict = {}
        self.fault: str | None = None
        self.outcome = Outcome()  # every step's since the last report, for the scheduler (``report``)
        self.evicts = False  # the step has evictions or chunk scores

    # ---- the model's layers ----

    def index_layers(self, names_to_o_proj: dict, heads: int | None = None, total: int | None = None) -> None:
        """``{attention layer name: a function returning its o_proj weight, or None}`` (read again
        when a selection needs the weight itself); with ``heads`` (Hq) each layer's W_O factor is
        computed now when the config reads it, so the weight is never held. ``total``: the model's
        attention layers where this worker holds some of them (a pipeline stage: its layers' names
        number them among all, ``model.layers.15`` the 16th), else these."""
        self.o_proj.update({n: f for n, f in names_to_o_proj.items() if f is not None})
        if heads and reads_factor(self.cfg):
            for name in names_to_o_proj:
                if name in self.o_proj:
                    self._factor(name, heads)
        names = sorted(
            names_to_o_proj, key=lambda n: int(m.group(1)) if (m := _LAYER.search(n)) else 0
        )
        first = min((int(m.group(1)) for n in names if (m := _LAYER.search(n))), default=0) if total else 0
        self.rank = {name: first + i for i, name in enumerate(names)}
        self.layers = total or max(len(names), 1)

    # ---- requests ----

    def admit(self, req_id: str, extra_args) -> None:
        """A new request: the config it runs, its own knobs in ``extra_args`` over the engine's
        (``per_request.resolve``, as the front end and the scheduler resolve them)."""
        knobs = per_request.knobs_of(extra_args)
        self.configs[req_id] = self.cfg if knobs is None else per_request.resolve(self.engine, knobs)

    def finish(self, req_ids) -> None:
        """Finished or aborted requests: their configs go (a preempted one keeps its own)."""
        for req_id in req_ids:
            self.configs.pop(req_id, None)

    def forget(self, req_ids) -> None:
        """Finished, aborted, preempted or resumed requests: their state, blocks and ring slot go."""
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_slots.append(state.slot)
            self.blocks.pop(req_id, None)
            self.pending.pop(req_id, None)

    def cut(self, req_id: str):
        """Cut the request's blocks to those its last eviction kept -> that ``settings.Eviction``, or
        None."""
        e = self.pending.pop(req_id, None)
        if e is not None:
            e.cut(self.blocks[req_id])
        return e

    def offsets(self, req_ids) -> np.ndarray:
        """Entries evicted by each request (logical positions - held entries)."""
        return np.array(
            [self.requests[r].offset if r in self.requests else 0 for r in req_ids], dtype=np.int64
        )

    # ---- a step ----

    def begin(self, req_ids, computed, counts, prompt_lens, device) -> None:
        """The step's batch, in its order: per request its id, tokens computed before, tokens in the
        step and prompt length (its blocks: ``blocks``). The host's part of the step (slots, ring
        rows) goes to ``device`` in one copy."""
        self.step = []
        self.flat, self.flat_tokens, self.flat_rows = {}, None, ()
        start = 0
        host = []  # arrays for the device: ring tokens, ring rows, offsets per token and per request, slots
        rows = self.ring.rows
        tokens, index = [], []
        for req_id, c, n, length in zip(req_ids, computed, counts, prompt_lens):
            c, n, length = int(c), int(n), int(length)
            row = np.asarray(self.blocks[req_id], dtype=np.int64)
            state = self.requests.get(req_id)
            if state is None:
                cfg = self.configs.get(req_id, self.cfg)
                state = self.requests[req_id] = RequestState(self.free_slots.pop(), cfg)
                self.ring.slots = max(self.ring.slots, state.slot + 1)
            s = self._scheduled(req_id, state, start, n, c, length, row)
            eviction, sums = s.eviction, s.sums
            self.step.append(s)
            last = min(n, rows)
            tokens.append(np.arange(start + n - last, start + n))
            index.append(state.slot * rows + np.arange(c + n - last, c + n) % rows)
            if sums or eviction is not None:
                host.append(self._slots(row, 0, s.end - state.offset))
                if eviction is not None and not settings.per_head(state.cfg):  # else on its heads' pages
                    host.append(
                        self._slots(
                            row, eviction.first_kept_block * self.block_size, eviction.budget
                        )
                    )
            start += n
        # the backend's own kernel sees a request whose heads hold their own pages as its step's
        # tokens only (its output for them is replaced, its write masked: ``attend_heads``)
        self.request_offsets = np.array(
            [s.computed if s.state.pages else s.state.offset for s in self.step], dtype=np.int64
        )
        per_token = np.repeat(self.request_offsets, [s.count for s in self.step])
        arrays = [np.concatenate(tokens), np.concatenate(index), per_token, self.request_offsets, *host]
        staged = stage(arrays, device)
        self.ring_tokens, self.ring_index, self.token_offsets_device, self.request_offsets_device = staged[:4]
        rest = iter(staged[4:])
        for s in self.step:
            if s.sums or s.eviction is not None:
                s.held_slots = next(rest)
                uniform = s.eviction is not None and not settings.per_head(s.cfg)
                s.kept_slots = next(rest) if uniform else None
        self._flatten(device)
        self.evicts = self.evicting()

    def _scheduled(self, req_id, state, start, count, computed, prompt_len, blocks) -> Scheduled:
        """One request's part of the step: whether it evicts at the step's end (``settings.eviction``) and
        adds chunk scores. A request whose rule raises does neither and fails (``failed``)."""
        s = Scheduled(req_id, state, start, count, computed, prompt_len, blocks, None, False)
        cfg = state.cfg
        if cfg is None:
            return s
        try:
            s.eviction = settings.eviction(
                cfg, computed, count, prompt_len, state.offset, self.caching, self.block_size, state.evicted
            )
            s.sums = settings.summed(cfg) and computed < prompt_len and settings.prompt_evicts(cfg, prompt_len)
            if s.eviction is not None and settings.per_head(cfg):
                self._pool(s)
        except Exception as e:  # noqa: BLE001 (contained to this request: ``failed``)
            self.failed[req_id] = why(e, "its eviction's rule")
            s.eviction, s.sums = None, False
        return s

    def _pool(self, s: Scheduled) -> None:
        """Per-head budgets, an evicting request: the pages of the blocks it keeps (``kept_pages``) and the
        free pages its layers place their kept entries on (``_place``): a first eviction under prefix caching
        the fresh blocks' (its held blocks stay whole), one in its own blocks those holding no entry yet;
        each layer adds its own once it has read them."""
        e, state = s.eviction, s.state
        first = e.first_kept_block
        s.kept_pages = self.space.pages(s.blocks[first : first + e.kept_blocks])
        if e.fresh:
            state.free = list(s.kept_pages)
        elif not state.pages:
            state.free = self.space.pages(s.blocks[e.held_blocks :])

    def _flatten(self, device) -> None:
        """The step's requests whose heads hold their own pages: their new blocks' pages, room for
        their tokens in every layer, each layer's ``FlatBatch``, their tokens (``flat_tokens``) and the
        (token, KV head) of each flattened row (``flat_rows``)."""
        flat = [s for s in self.step if s.state.pages]
        self.flat, self.flat_index, self.flat_tokens, self.flat_rows = {}, {}, None, ()
        if not flat:
            return
        appended: dict = {}  # layer name -> each request's new slots [Hkv, count]
        for s in flat:
            s.state.free += self.space.pages(s.blocks[s.state.placed :])
            s.state.placed = len(s.blocks)
            for name, pages in s.state.pages.items():
                appended.setdefault(name, []).append(pages.append(s.count))
        pages = {name: [s.state.pages[name] for s in flat] for name in flat[0].state.pages}
        self.flat = FlatBatch.layers(pages, [s.count for s in flat], device, appended)
        slots = torch.stack([batch.slot_mapping for batch in self.flat.values()])  # [layers, Hkv T]
        self.flat_index = dict(zip(self.flat, self.whole.page_index(slots.view(-1), len(self.flat))))
        tokens = np.concatenate([np.arange(s.start, s.start + s.count) for s in flat])
        heads = len(next(iter(pages.values()))[0].rows)  # KV heads
        *rows, self.flat_tokens = stage([*flat_rows(tokens, heads), tokens], device)
        self.flat_rows = tuple(rows)

    def _slots(self, blocks: np.ndarray, first: int, count: int) -> np.ndarray:
        """The slots of entries ``first`` .. ``first + count - 1`` of a request with ``blocks``."""
        j = np.arange(first, first + count)
        return blocks[j // self.block_size].astype(np.int64) * self.block_size + j % self.block_size

    def evicting(self) -> bool:
        return any(s.eviction is not None or s.sums for s in self.step)

    def _working(self, s: Scheduled) -> bool:
        """Whether request ``s`` has eviction work in this step (not once it failed)."""
        return (s.sums or s.eviction is not None) and s.req_id not in self.failed

    def layer(
        self, name: str, query: torch.Tensor, paged, scale: float, softcap, key=None, value=None, output=None
    ) -> None:
        """After layer ``name``'s attention: the attention of the requests whose heads hold their own
        pages (``attend_heads``: ``key``, ``value`` [T, Hkv, d] the step's, ``output`` [T, Hq d] the
        backend's), its queries [T, Hq, d] of the step to the ring, then each request's summed chunk
        scores and evictions, on ``paged`` (``restkv.vllm.paged.Paged``)."""
        self.done.add(name)
        try:
            if self.flat_tokens is not None:
                self.attend_heads(name, query, key, value, output, paged)
            self.ring.write(name, query, self.ring_tokens, self.ring_index)
        except Exception as e:  # noqa: BLE001 (every rank reaches the step's end: ``end`` stops the engine)
            self.fault = self.fault or f"restkv.vllm: {why(e, f'layer {name}')}; stopping before blocks are freed"
        if not self.evicts:
            return
        for s in filter(self._working, self.step):
            start = time.perf_counter()
            try:
                self._request_layer(name, s, query, paged, scale, softcap)
            except Exception as e:  # noqa: BLE001 (contained to this request: ``failed``)
                self.failed[s.req_id] = why(e, f"{s.cfg.method} in layer {name}")
            self._spent(s, start)

    def _request_layer(self, name, s: Scheduled, query, paged, scale, softcap) -> None:
        """Request ``s``'s work in layer ``name``: its chunk scores, then its eviction (or a deferred one's
        scores)."""
        if s.sums:
            self._add_chunk(name, s, query, paged, scale, softcap)
        if s.eviction is not None and settings.deferred(s.cfg):
            self._score(name, s, paged, scale, softcap)
        elif s.eviction is not None:
            self._evict(name, s, paged, scale, softcap)

    def _spent(self, s: Scheduled, start: float) -> None:
        """Host time since ``start`` on request ``s``, counted to its method."""
        seconds = self.outcome.seconds
        seconds[s.cfg.method] = seconds.get(s.cfg.method, 0.0) + time.perf_counter() - start

    def attend_heads(self, name, query, key, value, output, paged) -> None:
        """The requests whose heads hold their own pages: their step's keys and values to their heads'
        pages, and their rows of ``output`` from the layer's backend over the flattened batch (its G
        query heads on one KV head per sequence; vLLM's own write of their tokens was masked, its
        output for them is replaced)."""
        rows, heads = self.flat_rows, key.shape[1]
        keys, values = flatten(key, rows, heads)[:, 0], flatten(value, rows, heads)[:, 0]  # [Hkv T, d]
        self.whole.write_at(self.flat_index[name], keys, values)
        out = self.attends[name](flatten(query, rows, heads), self.flat[name], self.whole.cache)
        unflatten(output, rows, heads, out)

    def _observe(
        self, name, s: Scheduled, queries, keys, values, budget, scale, softcap, window=None, head_valid=None
    ):
        return observation(
            s.cfg,
            queries,
            keys,
            values,
            budget,
            scale,
            softcap,
            self.rank.get(name, 0),
            self.layers,
            self.o_proj.get(name),
            (lambda: self._factor(name, queries.shape[1])) if name in self.o_proj else None,
            window,
            head_valid,
            None if self.ranks is None else self.ranks.gather,
        )

    def _factor(self, name: str, heads: int) -> torch.Tensor:
        """The layer's W_O factor R [Hq, d, d], computed once."""
        if name not in self.factors:
            self.factors[name] = wo_factor(self.o_proj[name](), heads)
        return self.factors[name]

    def _add_chunk(self, name, s: Scheduled, query, paged, scale, softcap) -> None:
        keys, values = paged.read(s.held_slots)
        chunk = query[s.start : s.start + s.count]
        obs = self._observe(name, s, chunk, keys, values, s.end, scale, softcap, window=0)
        part = chunk_score(obs, s.cfg)
        before = s.state.sums.get(name)
        if before is not None:
            part[:, : before.shape[1]] += before
        s.state.sums[name] = part

    def _observed(self, name, s: Scheduled, paged, scale, softcap):
        """The request's observation in layer ``name`` at its eviction: the entries it holds, read back
        (from its heads' pages once it evicted with per-head budgets, laid out as ``HeadPages.layout`` at
        the widest head's width over every rank, as one device lays them out), and its most recent queries
        from the ring."""
        e = s.eviction
        if name in s.state.pages:
            pages = s.state.pages[name]
            width = pages.width() if self.ranks is None else self.ranks.most([pages.width()])[0]
            slots, held = pages.layout(s.cfg.window_size, width)  # every rank at one device's width
            heads, width = held.shape
            slots, held = stage([slots.reshape(-1), held.reshape(-1).astype(np.int64)], paged.cache.device)
            keys, values = (x.view(heads, width, -1).transpose(0, 1) for x in self.whole.read_pages(slots))
            head_valid = held.view(1, heads, width).bool()
        else:
            keys, values = paged.read(s.held_slots)
            head_valid = None
        queries = self.ring.read(name, s.state.slot, s.end, min(settings.query_rows(s.cfg), s.end))
        rank, layers = self.rank.get(name, 0), self.layers
        length = settings.schedule_length(s.cfg, s.prompt_len, s.end, s.computed < s.prompt_len)
        budget = settings.layer_budget(s.cfg, e.budget, length, rank, layers)
        return self._observe(name, s, queries, keys, values, budget, scale, softcap, head_valid=head_valid)

    def _evict(self, name, s: Scheduled, paged, scale, softcap) -> None:
        obs = self._observed(name, s, paged, scale, softcap)
        table = settings.layer_table(s.cfg, self.rank.get(name, 0), obs.keys.device)
        summed = s.state.sums.pop(name, None)
        if self.ranks is None or not settings.sized_across_heads(s.cfg):
            kept = kept_entries(obs, s.cfg, summed, table)
        else:  # the heads' split over every rank's heads
            scores = entry_scores(obs, s.cfg, summed)
            fit, sizes = layer_sizes(self.ranks, obs, s.cfg, scores, table)
            kept = kept_entries(obs, s.cfg, sizes=sizes, scores=scores, fit=fit)
        self._keep(name, s, kept, paged)

    def _keep(self, name, s: Scheduled, kept, paged) -> None:
        heads = kept.keys.shape[1]
        if settings.per_head(s.cfg):
            self._place(name, s, kept)
        else:
            rows = slot_rows(kept) if paged.scales is None else paged.stored(s.held_slots, kept.positions[0])
            paged.write(s.kept_slots, *rows)  # an FP8 cache's as stored: its bytes
            s.dropped += heads * max(0, s.eviction.held - kept.positions.shape[-1])
        s.heads += heads
        if not s.state.evicted and self.observer is not None:
            self.observer(s.req_id, name, kept.positions[0])

    def _score(self, name, s: Scheduled, paged, scale, softcap) -> None:
        """A deferred eviction's scores in layer ``name`` (``settings.deferred``); it selects in ``_finish``."""
        obs = self._observed(name, s, paged, scale, softcap)
        s.scores[name] = entry_scores(obs, s.cfg, s.state.sums.pop(name, None))
        self.later[name] = (paged, scale, softcap)

    def _finish(self, s: Scheduled) -> None:
        """A deferred eviction once every layer has run: the layers' shares of the budget from all their
        scores (``shared_sizes``, as ``restkv.configure``), its kept count from them (``_counted``), then each
        layer's selection placed on its pages."""
        names = sorted(s.scores, key=self.rank.get)
        scores = [s.scores.pop(n) for n in names]
        if self.ranks is None:
            fit, sizes = [None] * len(names), shared_sizes(s.cfg, scores, s.eviction.budget)
        else:  # over every rank's heads
            fit, sizes = layers_sizes(self.ranks, s.cfg, scores, s.eviction.budget)
        lengths = torch.stack(sizes)[:, 0] + s.cfg.window_size  # [layers, Hkv]
        self._counted(s, lengths.cpu().numpy())  # one host read per eviction; its own blocks (``settings.uncached``)
        for name, size, score, whole in zip(names, sizes, scores, fit):
            paged, scale, softcap = self.later[name]
            obs = self._observed(name, s, paged, scale, softcap)
            self._keep(name, s, kept_entries(obs, s.cfg, sizes=size, scores=score, fit=whole), paged)

    def _place(self, name, s: Scheduled, kept) -> None:
        """Per-head budgets: each head's kept entries on pages of its own (``HeadPages.placed``; one host
        read of the heads' counts, at the eviction only), from the request's free pages once the layer's
        own are among them (read: its pages, or in its first eviction in its own blocks its part of
        them), those of the blocks it keeps first; ``_settle`` moves the others in at the step's end."""
        e, state = s.eviction, s.state
        own = state.pages.pop(name, None)
        held = e.held * kept.keys.shape[1] if own is None else int(own.lengths.sum())
        if own is not None:
            state.free += own.release()
        elif not e.fresh:
            state.free += self.space.pages(s.blocks[: e.held_blocks], [name])
        inside = set(s.kept_pages)
        state.free.sort(key=lambda p: p not in inside)
        valid = kept.valid[0] if kept.valid.dim() == 3 else kept.valid.expand(kept.keys.shape[1], -1)
        lengths = valid.sum(-1).tolist()
        s.dropped += max(0, held - sum(lengths))
        pages = HeadPages.placed(state.free, lengths, self.block_size)
        slots = np.concatenate([pages.slots(h, 0, n) for h, n in enumerate(lengths)])
        self.whole.write_pages(torch.from_numpy(slots).to(kept.keys.device), kept.keys[0][valid], kept.values[0][valid])
        state.pages[name] = pages

    def _counted(self, s: Scheduled, lengths: np.ndarray) -> None:
        """Per-head budgets: the request's kept count from its heads' lengths [layers, Hkv] (every layer's,
        ``heads.exact_length``), for the scheduler (``report``), and the pages of the blocks that count keeps
        (``kept_pages``). Under tensor parallelism each rank holds other heads and all must count alike: the
        largest rank's count (``ranks``; the config's bound where no collective is given)."""
        exact = lengths.size == len(self.space.first) * self.space.heads
        exact = exact and (self.tensor_parallel == 1 or self.ranks is not None)
        length = exact_length(lengths, self.block_size) if exact else s.eviction.room
        if self.ranks is not None:
            (length,) = self.ranks.most([length])
        e = s.eviction = s.eviction.kept(length)
        s.kept_pages = self.space.pages(s.blocks[e.first_kept_block : e.first_kept_block + e.kept_blocks])

    def _settle(self, s: Scheduled) -> None:
        """Per-head budgets, after every layer's eviction: the pages outside the blocks the request keeps
        copied into free pages inside them (``heads.settle``), so the scheduler can give the others back."""
        moved_from, moved_to, s.state.free = settle(list(s.state.pages.values()), s.kept_pages)
        if len(moved_from):
            j = np.arange(self.block_size)
            slots = [(p[:, None] * self.block_size + j).reshape(-1) for p in (moved_from, moved_to)]
            source, target = stage(slots, self.whole.cache.device)
            self.whole.write_pages(target, *self.whole.read_pages(source))

    def end(self, scheduled: int | None = None) -> None:
        """After the step: each evicting request's new offset, its blocks to cut before the next step
        (``pending``, ``cut``) and its ``outcome.Kept`` for the scheduler; a request whose eviction failed
        is left as it was and reported failed (the scheduler finishes it with an error). Under tensor
        parallelism every rank's outcome is gathered first (``outcome.merged``). A step the plugin did
        not see whole raises instead, since the scheduler would free blocks still read: ``scheduled``
        tokens ran without ``begin``, or an attention layer did not call ``layer`` (its queries not in
        the ring, its eviction not run); so does a fault on any rank."""
        if scheduled and not self.step:
            raise RuntimeError(
                f"restkv.vllm: the model runner ran a step of {scheduled} tokens without the plugin's batch "
                "hook; stopping before its blocks are freed"
            )
        missed = sorted(self.rank.keys() - self.done, key=self.rank.get) if self.step else []
        self.done = set()
        if missed and not self.fault:
            name = missed[0]
            self.fault = (
                f"restkv.vllm: layer {name} ({self.backends.get(name, 'an unknown backend')}) ran its attention "
                "without the plugin in this step; stopping before its blocks are freed"
            )
        shared = self.ranks is not None and (self.evicts or self.flat_tokens is not None)
        kept = {}
        for s in filter(self._working, self.step):
            start = time.perf_counter()
            try:
                if s.eviction is not None:
                    kept[s.req_id] = self._conclude(s)
            except Exception as e:  # noqa: BLE001 (contained to this request: ``failed``)
                self.failed[s.req_id] = why(e, f"{s.cfg.method} at the step's end")
            self._spent(s, start)
        step = Outcome(kept, self.failed, fault=self.fault)
        step = merged(self.ranks.share(step) if shared else [step])  # raises a fault of any rank
        if self.relayed is not None:  # the earlier stages' (their layers): one outcome of every layer
            earlier, self.relayed = self.relayed, None
            step = merged([earlier, step], "pipeline stage")  # raises an earlier stage's fault
            for method, seconds in earlier.seconds.items():
                self.outcome.seconds[method] = self.outcome.seconds.get(method, 0.0) + seconds
        for s in self.step:
            if s.req_id in step.failed:
                self.pending.pop(s.req_id, None)
            elif s.req_id in step.kept:
                self._advance(s)
            elif s.sums and s.end >= s.prompt_len:
                s.state.sums.clear()
        self.outcome.kept.update(step.kept)
        self.outcome.failed.update(step.failed)
        self.step, self.failed, self.fault = [], {}, None
        self.flat, self.flat_tokens, self.flat_rows = {}, None, ()
        self.later = {}

    def _conclude(self, s: Scheduled) -> Kept:
        """Evicting request ``s`` after every layer ran: a deferred eviction selected (``_finish``), per-head
        budgets counted and their pages settled -> its ``outcome.Kept``."""
        if settings.deferred(s.cfg):
            self._finish(s)
        elif settings.per_head(s.cfg):
            self._counted(s, np.stack([pages.lengths for pages in s.state.pages.values()]))
        if settings.per_head(s.cfg):
            self._settle(s)
        return Kept(s.eviction.held, s.eviction.counted, s.dropped, s.heads)

    def _advance(self, s: Scheduled) -> None:
        """Request ``s`` evicted: its new offset, its blocks to cut before the next step."""
        s.state.offset += s.eviction.evicted
        s.state.evicted = True
        s.state.placed = s.eviction.kept_blocks
        s.state.sums.clear()
        self.pending[s.req_id] = s.eviction

    def report(self) -> Outcome:
        """Every step's outcome since the last report (the evictions and their counts, the failed
        requests, the host seconds spent evicting per method), for the scheduler."""
        out, self.outcome = self.outcome, Outcome()
        return out
