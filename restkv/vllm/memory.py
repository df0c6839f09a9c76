"""The vLLM plugin's own memory on one worker, term by term (no vLLM import): what vLLM's profiling
run never sees, so that the KV pool can be sized without it (``restkv.vllm.hooks.memory``).

Sizes are one tensor-parallel rank's (``Model.per_rank``, ``restkv.vllm.model_sizes``): ``layers``
attention layers, of which the plugin evicts ``evicted`` (a hybrid model's full-attention ones; vLLM frees
its sliding windows' blocks itself: the plugin neither reads, scores nor rings their queries), ``Hq`` /
``Hkv`` query / KV heads, head size ``d``, ``hidden`` (o_proj's rows), ``es`` bytes per element of the
entries an eviction reads back: the pool's (``kv_cache_dtype``, the model's dtype by default), float32
from an FP8 pool (1 byte an element, ``ps``: the pool's bytes per element). ``L`` is ``max_model_len``
(the most entries a request holds in a layer), ``S`` ``max_num_seqs``, ``r`` the queries an eviction
reads (``settings.query_rows``), ``B`` ``max_capacity_prompt``. "K+V" is one request's held entries of
one layer, ``2 L Hkv d es`` bytes; queries and the o_proj weight are in the model's dtype.

Held for the worker's life (``fixed``):

- query ring: ``evicted S r Hq d`` in the model's dtype, allocated for every slot on an evicted layer's
  first step (``ring.QueryRing``);
- W_O factors: ``evicted Hq d d`` float32 (the full-attention layers': the worker indexes no
  sliding-window layer), computed when the model is loaded and kept, for a config that reads them (``reads_factor``: ReST-KV's reconstruction with ``use_wo``, CriticalKV's
  ``value_norm="l2"``); the o_proj weight itself is not kept;
- a step's indices staged for the device (``Worker.begin``), int64: the queries the ring keeps (at
  most ``r`` per request, ``max_num_batched_tokens`` ``T`` in all) and their rows, an offset per
  token and per request: ``8 (T + 2 min(T, r S) + S)``;
- per-head or per-layer budgets (``restkv.vllm.heads``): a layer's queries, keys, values and output
  of the step flattened by KV head, at most ``4 T Hq d es`` at once; every layer's page tables of the step
  (``evicted Hkv S`` rows as wide as the widest head, at most ``max_model_len / block_size`` pages, int32 as
  staged) and its slots and their page axes (int64); one metadata builder for every layer (Triton's split-K
  scratch, ``builder_bytes``);
  and at a step's end one request's pages moved into the blocks it keeps, at most its kept entries of
  every layer, ``evicted`` x the K+V of ``B + block_size`` entries (in the pool's element) (LU-KV's curve and ``layer_ratios``:
  their largest layer's count over the prompts up to ``max_model_len``, ``settings.most_kept``).

During one eviction (one request in one layer at a time: the worker evicts them in turn):

- the held entries read back: 1 x K+V; from an FP8 pool also, while they are dequantized, their FP8
  copy (``2 L Hkv d``) and one float32 temporary of the keys or values (half a K+V);
- the observed queries' attention ``[Hq, r, L]`` float32, for a method that reads it (``SCRATCH``'s
  first column; with keys read back below float32 also one KV head's product and keys in float32);
- the selection's own scratch (``SCRATCH``, per scorer; strategies add theirs): a multiple of the
  K+V in float32, plus one of a block of ``observe.VALUE_BLOCK`` entries' K+V in float32 for the
  scorers that work a block at a time, plus blocks of a fixed size (R-KV's key similarities,
  CriticalKV's W_O-projected values). The multiples are what ``tests/core/test_vllm_memory.py``
  measures, op by op, for every method the plugin runs on two head geometries and dtypes, rounded
  up: the estimate bounds each and is at most 2x over it (2.25x for AdaKV with CriticalKV's L1 stage);
- the kept entries (``2 Hkv B d es``) and their rows as vLLM writes them (``2 Hkv B d ps``: an FP8
  pool's moved as stored); with per-head or
  per-layer budgets the kept set is as wide as its longest head (``kept_width``: up to ``Hkv B``
  where the heads share the layer's budget, the largest layer's budget for PyramidKV) and the
  rows written ``Hkv B`` entries; the kept set's indices, 4 int64 per head and kept entry; under
  ``decode_compression_ratio`` B is the largest budget of any check up to ``max_model_len``
  (``settings.most_budget``);
- for a config that reads the o_proj weight itself (``reads_weight``: CriticalKV's L1 norms, set-level
  refinement) the weight read back for the step: ``((Hq d)^2 + 2 Hq d hidden) es`` and one float32
  copy.

Per token a request holds (``per_token``, taken from the pool in proportion: ``fraction``): an H2O
prompt computed in chunks keeps ``[Hq, n]`` float32 summed scores per layer for its n tokens until
its last chunk (``evicted Hq 4`` bytes per token), and an evicting step stages the slots of the
entries held and kept (16 bytes per token). These grow with the tokens the pool holds, not with
``max_num_seqs``: a pool of N token slots needs ``N per_token`` bytes more at most (a slot: a token of
a block, ``Model.group_layers`` layers' K+V; a hybrid model's evicted group holds at most every block).

``python -m restkv.vllm.memory --model llama-3.1-8b --max-model-len 131072 --knobs '{...}'`` prints
the terms (a built-in name or a folder with a ``config.json``; ``--kv-cache-dtype fp8`` as vLLM's).
"""

from __future__ import annotations

import argparse
import json

from ..config import CompressionConfig
from ..methods.rkv import SIMILARITY_BLOCK
from ..scoring.observe import PROJECTION_BLOCK, VALUE_BLOCK
from . import settings
from .model_sizes import MODELS, Model, model_of


# scorer -> (whether it reads the observed queries' attention, multiple of the K+V in float32, of a
# VALUE_BLOCK's K+V in float32)
SCRATCH = {
    "snapkv": (True, 0.1, 0.0),
    "defensivekv": (True, 0.6, 0.0),
    "simlayerkv": (False, 0.25, 0.0),
    "tova": (True, 0.1, 0.0),
    "finch": (True, 0.8, 0.0),
    "cam": (True, 3.25, 0.0),
    "restkv": (True, 0.35, 0.75),
    "rkv": (True, 1.1, 0.0),
    "h2o": (False, 1.25, 0.0),
    "streamingllm": (False, 0.1, 0.0),
    "random": (False, 0.15, 0.0),
    "cur": (False, 0.15, 0.0),
    "lacache": (False, 0.3, 0.0),
    "l2norm": (False, 0.55, 0.0),
    "keydiff": (False, 0.35, 0.25),
    "lagkv": (False, 0.5, 0.9),
}
UNLISTED = (True, 3.25, 1.0)  # a scorer not measured: the largest of each

def reads_factor(cfg: CompressionConfig) -> bool:
    """The score reads the W_O factor R [Hq, d, d] (``Observation.wo``)."""
    if critical_stages(cfg) and cfg.get("value_norm") == "l2":
        return True
    return (
        cfg.scorer.scorer == "restkv.methods.restkv"
        and cfg.get("indicator") == "reconstruction"
        and bool(cfg.get("use_wo"))
    )


def reads_weight(cfg: CompressionConfig) -> bool:
    """The selection reads the o_proj weight itself [hidden, Hq d] (``Observation.o_proj``)."""
    return bool(critical_stages(cfg) and cfg.get("value_norm") == "l1") or bool(cfg.get("refine_rounds"))


def critical_stages(cfg: CompressionConfig) -> bool:
    """CriticalKV's two stages, W_O-projected value norms included (``critical``, DefensiveKV's score)."""
    return bool(cfg.get("critical")) or cfg.scorer.scorer.endswith(".defensivekv")


def kept_width(cfg: CompressionConfig, model: Model, held: int) -> int:
    """Entries per head of a kept set as the selection returns it (at most all held): its longest
    head's where the heads keep their own counts (HeadKV's table's longest; AdaKV's at most every
    head's share past the window, ``Hkv (B - w) + w``; LU-KV's all held; a budget shared across layers,
    every evicted layer's ``evicted Hkv (B - w) + w``; Hkv every rank's heads), else the largest layer's
    (``largest_layer``)."""
    budget = settings.most_budget(cfg, held)  # decode_compression_ratio: the largest up to ``held`` tokens
    kv_heads = model.kv_heads * model.ranks
    if settings.deferred(cfg):  # one layer's head may take every layer's and head's share
        return min(held, model.evicted * kv_heads * (budget - cfg.window_size) + cfg.window_size)
    if cfg.get("head_budget") == "headkv":
        return min(held, int(settings.head_table(cfg).max()) + cfg.window_size)
    if cfg.get("head_budget") == "lukv":  # a head may keep all it holds
        return held
    if settings.shares_heads(cfg):
        return min(held, kv_heads * (budget - cfg.window_size) + cfg.window_size)
    return largest_layer(cfg, model, held)


def largest_layer(cfg: CompressionConfig, model: Model, held: int) -> int:
    """Entries per head, on average over its heads, of the layer that keeps the most (at most all
    held): ``settings.largest``; with a budget shared across layers (``settings.deferred``) one layer
    may take every evicted layer's share past the window, ``evicted (B - w) + w``."""
    budget, w = settings.most_budget(cfg, held), cfg.window_size
    if settings.deferred(cfg):
        return min(held, model.evicted * (budget - w) + w)
    return min(held, settings.largest(cfg, budget, held))


def eviction_bytes(cfg: CompressionConfig, model: Model, held: int) -> dict:
    """The peak of one request's eviction (or H2O chunk score) in one layer holding ``held``
    entries, term by term (bytes)."""
    m, rows = model, settings.query_rows(cfg)
    kept = kept_width(cfg, m, held)
    scorer = cfg.scorer.scorer.rsplit(".", 1)[-1]
    attends, multiple, block_multiple = SCRATCH.get(scorer, UNLISTED)
    fixed = 0  # float32 elements of blocks of a fixed size (at most the whole)
    if scorer == "rkv":  # its key similarities [Hkv, rows, L], a few at once
        fixed += 4 * min(SIMILARITY_BLOCK + m.kv_heads * held, m.kv_heads * held * held)
    if critical_stages(cfg):
        multiple += 0.75
        if cfg.get("value_norm") == "l1":  # W_O-projected values [Hkv, n, hidden], and their norms
            fixed += 2 * min(PROJECTION_BLOCK + m.kv_heads * m.hidden, m.kv_heads * held * m.hidden)
        else:  # R-projected values [Hq, VALUE_BLOCK / g, d], a block at a time
            block_multiple += 1.25
    if cfg.get("chunk_size"):
        multiple += 0.1
    if cfg.get("refine_rounds"):
        multiple += 6.0
    attention = 0
    if attends:
        attention = m.heads * rows * held * 4
        if m.read_bytes < 4:  # one KV head's product and keys in float32 (Observation.attention)
            attention += attention // m.kv_heads + held * m.head_dim * 4
    weight = 0
    if reads_weight(cfg):
        width = m.heads * m.head_dim
        weight = (width * width + 2 * width * m.hidden) * m.dtype_bytes + width * m.hidden * 4
    if cfg.get("refine_rounds"):
        g = m.heads // m.kv_heads
        weight += m.kv_heads * g * g * m.head_dim**2 * 4  # M_ac
    read = m.kv_bytes(held, m.read_bytes)
    if m.pool_bytes == 1:  # an FP8 pool's: its bytes copied, then one float32 temporary of K or V
        read += m.kv_bytes(held, 1) + read // 2
    return {
        "read back (1 x K+V)": read,
        "observed queries' attention": attention,
        "selection scratch": int(
            multiple * m.kv_bytes(held, 4)
            + block_multiple * m.kv_bytes(min(held, VALUE_BLOCK), 4)
            + fixed * 4
        ),
        # the rows written: a layer's heads' entries together, at most the largest layer's; and the kept
        # set's indices (where, which position, which slot: 4 int64 per head and entry)
        "kept entries and their rows": m.kv_bytes(kept, m.read_bytes)
        + m.kv_bytes(largest_layer(cfg, m, held), m.pool_bytes)
        + 32 * m.kv_heads * kept,
        "o_proj weight read": weight,
    }


def fixed_bytes(
    cfg: CompressionConfig,
    model: Model,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int = 0,
    block_size: int = 16,
) -> dict:
    """Every term that does not grow with the pool (bytes), the eviction's as one."""
    m, tokens = model, max_num_batched_tokens
    rows = settings.query_rows(cfg)
    most = settings.most_kept(cfg, settings.most_budget(cfg, max_model_len), max_model_len)
    moved = min(max_model_len, most + block_size)  # a request's kept entries per head, on average
    return {
        "step's staged indices": 8 * (tokens + 2 * min(tokens, rows * max_num_seqs) + max_num_seqs),
        "query ring": m.evicted * max_num_seqs * rows * m.heads * m.head_dim * m.dtype_bytes,
        "W_O factors": m.evicted * m.heads * m.head_dim**2 * 4 if reads_factor(cfg) else 0,
        # while decoding with per-head budgets the heads are read laid out on the longest head's entries,
        # at most every token seen: max_model_len too
        "one eviction": sum(eviction_bytes(cfg, m, max_model_len).values()),
        # per-head or per-layer budgets: the step's queries, keys, values and output flattened by head
        "flattened attention": 4 * tokens * m.heads * m.head_dim * m.dtype_bytes if settings.per_head(cfg) else 0,
        # per-head or per-layer budgets: every layer's flattened batch of the step, built at once (``FlatBatch.layers``):
        # int32 page tables as wide as the widest head (at most max_model_len's pages) and lengths per (head,
        # request), the slots and their three page axes (int64) per (head, token)
        "flattened page tables": (
            m.evicted * m.kv_heads * (max_num_seqs * 4 * (-(-max_model_len // block_size) + 1) + tokens * 32)
            if settings.per_head(cfg) else 0
        ),
        # per-head or per-layer budgets: one request's pages moved into its kept blocks at a step's end
        "pages moved": m.evicted * m.kv_bytes(moved, m.pool_bytes) if settings.per_head(cfg) else 0,
        # per-head or per-layer budgets: the one metadata builder every layer's flattened batch shares
        # (``hooks.attention.single_head``), Triton's with its split-K scratch (the CPU backend's holds none)
        "attention builder": builder_bytes(m) if settings.per_head(cfg) else 0,
    }


TRITON_ROWS = 128  # vLLM's Triton builder: its scratch has at most MIN_LAUNCH_GRID_SIZE_2D rows (0.32.0 to 0.34.0)
TRITON_SEGMENTS = 16  # ... of NUM_PAR_SOFTMAX_SEGMENTS segments each


def builder_bytes(model: Model) -> int:
    """vLLM's Triton metadata builder's split-K scratch as the per-head path builds it (one, shared by the
    layers), at most: 128 rows (0.32.0: ``128 // Hkv``; 0.33.0 at most ``max_num_seqs`` of those; 0.34.0
    ``128 // 1`` for the single-head spec, at most ``max_num_seqs``) of every query head's 16 segments, each a
    float32 output of the head size padded to a power of 2 and its maximum and sum."""
    m = model
    padded = 1 << (m.head_dim - 1).bit_length()
    return TRITON_ROWS * m.heads * TRITON_SEGMENTS * (padded + 2) * 4


def per_token(cfg: CompressionConfig, model: Model) -> int:
    """Bytes per token held in the pool: H2O's chunk sums (every evicted layer), a deferred eviction's
    scores (every evicted layer's [Hkv, P] float32, ``settings.deferred``) and the staged slots."""
    sums = model.evicted * model.heads * 4 if settings.summed(cfg) else 0
    scores = model.evicted * model.kv_heads * 4 if settings.deferred(cfg) else 0
    return sums + scores + 16


def fraction(cfg: CompressionConfig, model: Model) -> float:
    """``per_token`` over the pool's bytes per token slot (a block's K+V of one token: ``group_layers``
    layers', in the pool's element)."""
    return per_token(cfg, model) / model.block_bytes(1)


def reserved(
    cfg: CompressionConfig,
    model: Model,
    max_num_seqs: int,
    max_model_len: int,
    available: int,
    max_num_batched_tokens: int = 0,
    block_size: int = 16,
) -> int:
    """Bytes to leave out of ``available`` so that the pool of what is left, plus the plugin at its
    peak, fits: ``fixed + (available - fixed) f / (1 + f)``."""
    fixed = sum(fixed_bytes(cfg, model, max_num_seqs, max_model_len, max_num_batched_tokens, block_size).values())
    f = fraction(cfg, model)
    return fixed + max(0, int((available - fixed) * f / (1 + f)))


def knobs_flag(text: str) -> dict:
    """The ``--knobs`` flag's JSON; a one-line exit when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--knobs must be a JSON object of restkv knobs: {e}") from None


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=f"{', '.join(MODELS)}, or a folder with a config.json")
    p.add_argument("--dtype", default=None, help="the model's dtype (default: its config's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's (auto: the model's dtype; fp8: 1 byte)")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="tokens per step (0: not counted)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--knobs", default='{"method": "snapkv"}', help="the plugin's knobs (JSON)")
    a = p.parse_args(argv)
    cfg = settings.from_env({"restkv": knobs_flag(a.knobs)})
    try:
        model = model_of(a.model, a.dtype, a.kv_cache_dtype).per_rank(a.tensor_parallel_size)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(f"{a.model}, per rank: {model}; max_model_len {a.max_model_len}, max_num_seqs {a.max_num_seqs}")
    sizes = (a.max_num_seqs, a.max_model_len, a.max_num_batched_tokens, a.block_size)
    for name, n in fixed_bytes(cfg, model, *sizes).items():
        print(f"  {name}: {_mib(n)}")
    for name, n in eviction_bytes(cfg, model, a.max_model_len).items():
        print(f"    {name}: {_mib(n)}")
    layer_kv = model.kv_bytes(a.max_model_len, model.pool_bytes)
    print(f"  (one layer's K+V at max_model_len: {_mib(layer_kv)})")
    print(f"  per token held: {per_token(cfg, model)} B, {fraction(cfg, model):.2%} of the pool")


if __name__ == "__main__":
    main()
