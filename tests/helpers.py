"""Helpers shared by the tests: tiny random models of every family (no download), prompts, reference
decoding, and fixture data in the benchmarks' official schemas."""

from __future__ import annotations

import json
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import AttentionInterface
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import restkv
from restkv.compat import cache_argument as CACHE  # "cache", or "past_key_values" (transformers 5.17)

ROOT = Path(__file__).resolve().parents[1]  # the repository


def cache_of(out):
    """The cache a forward or ``generate()`` returned (``cache``, or ``past_key_values`` in transformers 5.17)."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def tiny_tokenizer() -> str:
    """Folder of a character-level tokenizer whose ids fit the tiny models' vocabulary (built once)."""
    path = Path(tempfile.gettempdir()) / f"restkv-tiny-tokenizer-{os.getuid()}"
    if not (path / "tokenizer.json").is_file():
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(["\n", *map(chr, range(32, 127))])}}  # 97 ids
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # every character, "\n" too
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + "."))
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process made it first
            pass
    return str(path)


def lukv_curve(path, layers: int = 3, hkv: int = 2, seed: int = 0, spread: float = 0.15) -> str:
    """An LU-KV budget curve [99, layers, hkv] written to ``path`` (.npy): row i's prune ratios are
    (i + 1) / 100 plus uniform noise of +-``spread``, clipped to [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(1, 100, dtype=torch.float64)[:, None, None] / 100
    noise = (torch.rand(99, layers, hkv, generator=g, dtype=torch.float64) * 2 - 1) * spread
    np.save(path, (rows + noise).clamp(0, 1).numpy())
    return str(path)


def tiny_lukv_curve() -> str:
    """An LU-KV budget curve file for the tiny models (3 layers, 2 KV heads; written once)."""
    path = Path(tempfile.gettempdir()) / f"restkv-tiny-lukv-{os.getuid()}.npy"
    if not path.is_file():
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.stem + ".")) / "curve.npy"
        os.replace(lukv_curve(tmp), path)
    return str(path)


# knobs a method needs on the 3-layer models below
SMALL_MODEL = {"lacache": dict(span=2), "kvzip": dict(tokenizer=tiny_tokenizer(), repeat_chunk=24),
               "restkv_repeat": dict(tokenizer=tiny_tokenizer(), repeat_chunk=24),
               "dms": dict(tokenizer=tiny_tokenizer(), repeat_chunk=24),
               "simlayerkv": dict(n_recent=8, lazy_threshold=0.0),  # every layer lazy on a short prompt
               "qfilter": dict(tokenizer=tiny_tokenizer(), qfilter_sequences=2, qfilter_length=256),
               "kvgrad": dict(tokenizer=tiny_tokenizer(), repeat_chunk=24),
               "expected_attention_stats": dict(tokenizer=tiny_tokenizer(), stats_samples=2,
                                                stats_length=200),
               "duo_attention": dict(tokenizer=tiny_tokenizer(), head_compression_ratio=0.5,
                                     duo_samples=2, duo_length=128, sink_size=4, recent_size=8),
               "kvzap": dict(tokenizer=tiny_tokenizer(), train_windows=2, train_length=128),
               "fastkvzip": dict(tokenizer=tiny_tokenizer(), train_windows=2, train_length=128),
               "lukv": dict(lukv_curve=tiny_lukv_curve()),
               "triattention": dict(tokenizer=tiny_tokenizer(), triattention_length=256)}


def random_weights(cfg, d: int, hkv: int, groups: int, seed: int = 0):
    """Random weights of a trained method (KVzap, Fast KVzip) for one layer, as ``obs.data`` holds them."""
    from restkv.integration import trained

    g = torch.Generator().manual_seed(seed)
    if cfg.method == "fastkvzip":
        gate = trained.new_gate(d, hkv, groups, g)
        gate["k_base"] = torch.randn(gate["k_base"].shape, generator=g)
        gate["b"] = torch.randn(gate["b"].shape, generator=g)
        return gate
    return (trained.new_mlp if cfg.get("kvzap_type") == "mlp" else trained.new_linear)(d, hkv, g)


def small(method, family="llama", **knobs):
    """``configure`` knobs of ``method`` on a tiny model of ``family`` (None: the method cannot run there)."""
    if method == "lacache" and family == "gemma3":
        return None  # its ladder needs more than one evicted layer; the tiny Gemma 3 has one global layer
    return dict(method=method, **SMALL_MODEL.get(method, {}), **knobs)


def rope_embed(d: int, base: float = 10000.0):
    """positions [b, n] -> (cos, sin) [b, n, d] float32 of the standard RoPE (transformers' default), in float64."""
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def embed(positions):
        angles = positions[..., None].double() * inv_freq
        angles = torch.cat([angles, angles], -1)
        return angles.cos().float(), angles.sin().float()

    return embed


COMMON = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    ),
}


def tiny_model(family: str = "llama", attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    config._attn_implementation = attn_implementation
    return model_cls(config).eval()


def prompt(n=80, batch=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (batch, n), generator=g)


def generate(model, ids, mask=None, n=6, **kw):
    out = model.generate(
        ids, attention_mask=mask if mask is not None else torch.ones_like(ids), max_new_tokens=n,
        do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw
    )
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def sweep_equals_separate_runs(model, ids, configs, n):
    """``restkv.sweep`` of ``configs`` on ``ids``, checked against configuring and generating each one alone
    (same tokens, same kept positions); returns the sweep's ``(tokens, kept)`` per config."""
    swept = restkv.sweep(model, ids, None, configs, n, pad_token_id=0)
    for cfg, (tokens, kept) in zip(configs, swept):
        restkv.configure(model, **cfg)
        ref, _ = generate(model, ids, n=n)
        assert torch.equal(tokens, ref), cfg
        assert all(torch.equal(a, b) for a, b in zip(kept, restkv.kept_positions(model)) if a is not None), cfg
    return swept


def masked_reference_logits(model, ids, kept, n_new, window=None, channels=None, recent=0):
    """Greedy decoding on the FULL cache with, per layer and head, every entry outside ``kept`` masked.

    ``kept`` per layer [b, H, K] prompt positions (-1: nothing), with H the KV heads or the query heads
    (one kept set per query head); every decoded entry is seen. Or, for a cache that evicts while decoding,
    a list over the decoding steps of such lists: step t holds the positions (prompt and decoded) held before
    the t-th fed token, which itself is always seen.
    ``window``: a sliding window W over every layer, as the model's sliding-window mask (query t sees keys > t - W).
    ``channels`` per layer [b, H, c] (or None): the key channels kept by the prompt entries before the last
    ``recent``; their other channels read as zeros.
    """
    name = "restkv_test_masked"
    steps = kept if kept and isinstance(kept[0], (list, tuple)) else None
    step = [0]

    def masked_eager(module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, hq, q, d = query.shape
        g = hq // key.shape[1]
        k = key.repeat_interleave(g, 1).float()
        v = value.repeat_interleave(g, 1).float()
        if q == 1 and channels is not None and channels[module.layer_idx] is not None:
            c = channels[module.layer_idx]
            on = torch.zeros(b, c.shape[1], d).scatter_(-1, c, 1.0).repeat_interleave(hq // c.shape[1], 1)
            k[:, :, : ids.shape[1] - recent] *= on[:, :, None, :]
        logits = query.float() @ k.transpose(-1, -2) * scaling
        t = torch.arange(key.shape[2] - q, key.shape[2])[:, None]  # the queries' positions
        too_old = torch.arange(key.shape[2])[None, :] <= t - (window or key.shape[2] + 1)  # [q, kv] beyond the window
        if q == 1:
            n = key.shape[2] if steps else ids.shape[1]  # the masked span: every entry, or the prompt's
            held = (steps[step[0]] if steps else kept)[module.layer_idx]
            idx = held.masked_fill(held < 0, n)  # -1: nothing kept there
            heads = idx.shape[1]
            allowed = torch.ones(b, heads, key.shape[2], dtype=torch.bool)
            allowed[..., :n] = torch.zeros(b, heads, n + 1, dtype=torch.bool).scatter_(2, idx, True)[..., :n]
            allowed[..., -1] = True  # the fed token itself
            logits = logits.masked_fill(~allowed.repeat_interleave(hq // heads, 1)[:, :, None] | too_old, float("-inf"))
        else:
            future = torch.ones(q, key.shape[2], dtype=torch.bool).triu(1 + key.shape[2] - q)
            logits = logits.masked_fill(future | too_old, float("-inf"))
        out = (logits.softmax(-1) @ v).to(query.dtype)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, masked_eager)
    restkv.configure(model, method="fullkv")
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        out = model(ids, use_cache=True, **{CACHE(model): DynamicCache()})  # full layers, sliding-window model too
        cache, steps_out = cache_of(out), [out.logits[:, -1]]
        for t in range(n_new - 1):
            step[0] = t
            nxt = steps_out[-1].argmax(-1, keepdim=True)
            out = model(nxt, use_cache=True, **{CACHE(model): cache})
            steps_out.append(out.logits[:, -1])
    finally:
        model.config._attn_implementation = previous
    return torch.stack(steps_out, 1)


def capture(model, ids, values=False) -> dict:
    """{layer: (queries, keys, scaling)} in float64 of a plain causal forward of ``ids`` (restkv detached);
    with ``values``: (queries, keys, values, scaling)."""
    got, name = {}, "restkv_test_capture"

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        got[module.layer_idx] = (query.double(), key.double(), *((value.double(),) if values else ()), scaling)
        g = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attend)
    restkv.detach(model)
    previous, model.config._attn_implementation = model.config._attn_implementation, name
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.config._attn_implementation = previous
    return got


ZH = {"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"}
CLASSES = {"trec": ["Individual", "Distance", "City"], "lsht": ["体育", "财经", "教育"]}
ANSWERS = {"trec": "City", "lsht": "体育", "passage_retrieval_en": "Paragraph 2",
           "passage_retrieval_zh": "段落2", "passage_count": "3", "lcc": "return a + b",
           "repobench-p": "return a + b"}


def fixture_record(dataset, i, words=40, length=1000):
    """One record of ``dataset`` in the official schema."""
    zh = dataset in ZH
    filler = ("北京有很多公园。" if zh else "The river Quell runs past {} old mills. ").format(i)
    return {"input": f"问题{i}？" if zh else f"Which river is in story {i}?",
            "context": (filler * words).strip(),
            "answers": [ANSWERS.get(dataset, "北京" if zh else "the river Quell")],
            "length": length, "dataset": dataset, "language": "zh" if zh else "en",
            "all_classes": CLASSES.get(dataset), "_id": f"{dataset}-{i}"}


def write_fixture(folder, datasets, n=2, suffix="", **kw):
    os.makedirs(folder, exist_ok=True)
    for d in datasets:
        with open(os.path.join(folder, f"{d}{suffix}.jsonl"), "w", encoding="utf-8") as fh:
            for i in range(n):
                fh.write(json.dumps(fixture_record(d, i, **kw), ensure_ascii=False) + "\n")
    return str(folder)


def passkey_record(i, words=8):
    filler = "The grass is green. The sky is blue. " * words
    key = str(50000 + 1111 * i)
    return {"id": i, "context": f"{filler}The pass key is {key}. Remember it. {key} is the pass key. {filler}",
            "input": "What is the pass key?", "answer": [key], "options": []}


def write_passkey(folder, n=2, **kw):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "passkey.jsonl"), "w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps(passkey_record(i, **kw)) + "\n")
    return str(folder)


class PeakBytes(TorchDispatchMode):
    """The peak bytes of the storages allocated inside the block and still referenced (views and in-place
    results of an input count nothing)."""

    def __init__(self):
        super().__init__()
        self.live = {}  # storage address -> [tensors referencing it, bytes]
        self.held = self.peak = 0

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[0] -= 1
        if not entry[0]:
            self.held -= entry[1]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.live:
                if not ptr or ptr in inputs or func.is_view:
                    continue
                self.live[ptr] = [0, t.untyped_storage().nbytes()]
                self.held += self.live[ptr][1]
                self.peak = max(self.peak, self.held)
            self.live[ptr][0] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def fewest_length(lengths, bs: int) -> int:
    """Brute force: the shortest count of entries whose blocks (one single-head page per head and layer
    each: ``len(lengths)`` pages) hold the pages of heads holding ``lengths`` entries, while each head
    appends one entry per token."""
    lengths = [int(n) for n in np.asarray(lengths).reshape(-1)]
    heads = len(lengths)

    def fits(count):
        return all(-(-(count + t) // bs) * heads >= sum(-(-(n + t) // bs) for n in lengths) for t in range(2 * bs))

    return next(count for count in range(1, 2 * max(lengths) + 2 * bs) if fits(count))


def on_ranks(n: int, work) -> list:
    """``work(ranks)`` on ``n`` threads, one per tensor-parallel rank, each given a ``restkv.vllm.ranks.Ranks``
    whose gather and maxima go through the other threads as vLLM's collectives go through the other ranks
    (each call waits for every rank's) -> each rank's result."""
    import threading

    from restkv.vllm.ranks import Ranks

    barrier = threading.Barrier(n, timeout=120)
    given: list = [None] * n

    def exchange(r: int, x) -> list:
        given[r] = x
        barrier.wait()
        every = list(given)
        barrier.wait()
        return every

    def ranks(r: int) -> Ranks:
        gather = lambda x: torch.cat(exchange(r, x), 1)  # noqa: E731 (one line per collective)
        return Ranks(r, n, gather, lambda v: [max(c) for c in zip(*exchange(r, v))], lambda x: exchange(r, x))

    out: list = [None] * n
    errors: list = []

    def run(r: int) -> None:
        try:
            out[r] = work(ranks(r))
        except BaseException as e:  # noqa: BLE001 (raised again below, the others released)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
