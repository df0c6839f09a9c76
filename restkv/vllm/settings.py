"""The plugin's configuration and the rules both of vLLM's sides apply: no vLLM import here.

``RESTKV_VLLM`` (a JSON object) holds the knobs of ``restkv.configure`` (``method``,
``max_capacity_prompt``, ``window_size``, ``decode_interval``, the method's own); an engine's
``additional_config={"restkv": {...}}`` (``--additional-config`` of ``vllm serve``) takes precedence
over it. Neither set: the plugin changes nothing.

The rules (``eviction``, ``hit_limit``, the block counts) are what the scheduler, which frees and
allocates blocks, and every worker, which rewrites the cache, both compute from the same numbers,
so they agree without a message.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

import torch

from ..config import CompressionConfig
from ..strategies.budgets import check_layers, fits, keeps_prompt, layer_budgets, ratio_budgets
from ..strategies.head_budgets import headkv_budgets, load_head_importance, load_lukv_curve, lukv_sizes
from .heads import equivalent_length

ENV = "RESTKV_VLLM"
"""The environment variable holding the plugin's knobs as a JSON object."""

PER_HEAD = ("adakv", "threshold", "headkv", "lukv")
"""``head_budget`` values served on single-head pages: each KV head keeps its own count."""
SHARED = ("adakv", "headkv")
"""Those of ``PER_HEAD`` whose heads' counts depend on the other heads (refused under tensor parallelism)."""
PER_LAYER = ("pyramid",)
"""``layer_budget`` values served on single-head pages: a schedule of the config, each layer its own count."""
DEFERRED = ("global",)
"""``layer_budget`` values whose counts the scores decide across layers: selected once every layer has
run (``Worker.end``), the kept count sent to the scheduler with the step's output."""
UNBOUNDED = 1 << 62
"""``largest`` where no count from the config bounds a layer's (``DEFERRED``): it may keep all it holds."""

# knob -> (whether its value can run, what vLLM needs): vLLM's block table holds one entry count per
# request
_KNOB_NEEDS = {
    "layer_budget": (
        lambda v: v in ("uniform", *PER_LAYER, *DEFERRED),
        f"'uniform' or {', '.join(map(repr, (*PER_LAYER, *DEFERRED)))}",
    ),
    "head_budget": (  # every value configure() has runs; a new one is refused until the plugin counts it
        lambda v: v in ("uniform", *PER_HEAD),
        f"'uniform' or {', '.join(map(repr, PER_HEAD))} (a share of the layer's budget per KV head)",
    ),
    "gqa_agg": (lambda v: v != "none", "a reduction to one kept set per KV head, not 'none'"),
    "max_capacity_prompt_ratio": (lambda v: v is None, "none: give max_capacity_prompt"),
    "quant_method": (
        lambda v: v is None,
        "none: vLLM holds the cache (its kv_cache_dtype quantizes)",
    ),
    "pruning_ratio": (lambda v: v is None, "none: vLLM's cache keeps every key channel"),
    "query_proxy": (lambda v: v == "window", "'window' (the others read every query before RoPE)"),
    "rerotate_keys": (
        lambda v: v in (None, "none"),
        "none: vLLM's cache holds the keys as RoPE rotated them",
    ),
}

# Methods whose score reads what the attention backend does not give it: every query of the prompt
# (other than as a sum, see ``SUMMED``), the queries or keys before RoPE, or constants of the model.
_METHOD_NEEDS = {
    "cap": "the queries before RoPE",
    "compactor": "every query of the prompt",
    "noncausal": "every query of the prompt",
    "qfilter": "the model's Q-Filters, computed from its queries before RoPE",
    "expected_attention": "the queries before RoPE",
    "expected_attention_stats": "the model's query statistics, computed before RoPE",
    "duo_attention": "the queries and keys before RoPE",
    "leverage": "the keys before RoPE",
    "triattention": "the queries and keys before RoPE",
}

# Methods whose score is a sum over the queries it is given: over a prompt computed in chunks it is
# the sum of the chunks' scores (each chunk's queries over the keys before them).
SUMMED = ("restkv.methods.h2o",)
"""Scorer modules whose score is a sum over the queries it is given (so chunked prefill adds up chunks)."""


def from_env(additional: dict | None = None) -> CompressionConfig | None:
    """The config the plugin runs (None: the plugin is off), validated; a bad one raises a one-line
    ValueError."""
    knobs = (additional or {}).get("restkv")
    source = "additional_config['restkv']"
    if knobs is None:
        text = os.environ.get(ENV)
        if not text:
            return None
        source = ENV
        try:
            knobs = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV} must be a JSON object of restkv knobs: {e}") from None
    if not isinstance(knobs, dict):
        raise ValueError(
            f"{source} must be a JSON object of restkv knobs; got {type(knobs).__name__}"
        )
    cfg = CompressionConfig.from_kwargs(**knobs)
    check(cfg)
    return cfg


def check(cfg: CompressionConfig, source: str = ENV) -> None:
    """Raise a one-line ValueError, naming ``source`` (where the knobs came from), for a config the
    plugin cannot run in vLLM."""
    if not cfg.evicts:
        raise ValueError(
            f"{source}: method {cfg.method} keeps every entry; unset {source} to run plain vLLM"
        )
    if cfg.scorer.replays:
        raise ValueError(
            f"{source}: method {cfg.method} scores with forward passes of its own after the prefill; "
            "the vLLM plugin runs methods that read the prefill's queries and keys only"
        )
    if cfg.scorer.reads_hidden:
        raise ValueError(
            f"{source}: method {cfg.method} scores the layers' hidden states, which vLLM's attention "
            "backend does not see"
        )
    needs = _METHOD_NEEDS.get(cfg.scorer.scorer.rsplit(".", 1)[-1])
    if needs:
        raise ValueError(
            f"{source}: method {cfg.method} needs {needs}, which vLLM's attention backend does not see"
        )
    for name, (runs, needed) in _KNOB_NEEDS.items():
        if name in cfg and not runs(cfg[name]):
            raise ValueError(f"{source}: {name}={cfg[name]!r} cannot run in vLLM; it needs {needed}")
    refused = per_head_refusals(cfg)
    if refused:
        raise ValueError(f"{source}: {refused[0]}")


def shares_heads(cfg: CompressionConfig) -> bool:
    """A layer's budget is shared among its KV heads by their scores (AdaKV), each keeping its own
    count (a threshold's counts are each head's own)."""
    return cfg.get("head_budget") in SHARED


def per_head(cfg: CompressionConfig) -> bool:
    """Its KV heads keep counts other than ``max_capacity_prompt`` (per head or per layer): their
    entries go on single-head pages (``restkv.vllm.heads``)."""
    return cfg.get("head_budget") in PER_HEAD or per_layer(cfg) or deferred(cfg)


def per_layer(cfg: CompressionConfig) -> bool:
    """Its layers keep budgets of their own from the config: PyramidKV's schedule (``PER_LAYER``) or
    ``layer_ratios`` (``restkv.strategies.budgets.layer_budgets``)."""
    return cfg.get("layer_budget") in PER_LAYER or cfg.get("layer_ratios") is not None


def deferred(cfg: CompressionConfig) -> bool:
    """Its layers' counts come from every layer's scores (``layer_budget="global"``): a request's
    kept count is known after its step only."""
    return cfg.get("layer_budget") in DEFERRED


def uncached(cfg: CompressionConfig, prompt_len: int) -> bool:
    """A request whose blocks are its own: it neither takes nor gives prefix-cache hits, so its
    eviction writes over its blocks (``deferred`` with a prompt over the budget: its evicting step may
    keep all it holds, and fresh blocks for that would hold the prompt twice)."""
    return deferred(cfg) and prompt_evicts(cfg, prompt_len)


def prompt_evicts(cfg: CompressionConfig, prompt_len: int) -> bool:
    """Its prompt's end evicts, as ``restkv.configure`` decides (``keeps_prompt``): the prompt is longer
    than its budget (with ``layer_ratios``, its smallest layer's), or a threshold selects."""
    return not keeps_prompt(cfg, prompt_len)


def budget_knobs(cfg: CompressionConfig) -> str:
    """Its per-layer and per-head budget knobs other than uniform, as ``knob='value'`` (for errors)."""
    knobs = ("layer_budget", "layer_ratios", "head_budget")
    return ", ".join(f"{k}={cfg[k]!r}" for k in knobs if cfg.get(k, "uniform") not in ("uniform", None))


def per_head_refusals(cfg: CompressionConfig) -> list[str]:
    """Why per-head or per-layer budgets cannot run with these knobs (one line each)."""
    if not per_head(cfg):
        return []
    lines = []
    if cfg.get("head_budget") == "headkv" and not cfg.get("head_importance"):
        lines.append(
            "head_budget='headkv' needs head_importance=FILE in vLLM (a HeadKV table; `python -m "
            "restkv.bench.head_scores --model_path MODEL` writes the one configure() computes)"
        )
    return lines


_TABLES: dict = {}  # config -> (the model's layers, heads, KV heads; HeadKV's counts [layers, Hkv] or
# LU-KV's curve [99, layers, Hkv] for it)
_LAYERS: dict = {}  # config -> the model's attention layers (``bind_model``)
_RANKS: dict = {}  # config -> its tensor-parallel ranks (``bind_model``)


def bind_model(cfg: CompressionConfig, layers: int, heads: int, kv_heads: int, ranks: int = 1) -> None:
    """Read what the config needs of the model before any request: its ``layers`` attention layers
    (PyramidKV's schedule over them), HeadKV's head-importance table, shared among their ``kv_heads``
    heads (``heads`` query heads; every rank's), as ``restkv.configure`` shares it, LU-KV's budget curve;
    ``ranks`` the tensor-parallel ranks sharing the heads. A file that does not fit the model raises a
    one-line ValueError."""
    model = (layers, heads, kv_heads)
    check_layers(cfg, layers)
    _LAYERS[cfg] = layers
    _RANKS[cfg] = ranks
    if _TABLES.get(cfg, (None,))[0] == model:
        return
    if cfg.get("head_budget") == "headkv":
        importance = load_head_importance(cfg.head_importance, layers, heads, kv_heads)
        base = cfg.max_capacity_prompt - cfg.window_size
        _TABLES[cfg] = (model, headkv_budgets(importance, base, cfg.headkv_beta))
    if cfg.get("head_budget") == "lukv":
        _TABLES[cfg] = (model, load_lukv_curve(cfg.lukv_curve, layers, kv_heads))


def head_table(cfg: CompressionConfig):
    """HeadKV's prefix entries per head [layers, Hkv] (window excluded), or LU-KV's curve [99, layers, Hkv],
    from ``bind_model``."""
    if cfg not in _TABLES:
        raise RuntimeError(f"restkv.vllm: {budget_knobs(cfg)} before settings.bind_model read its table")
    return _TABLES[cfg][1]


def schedule_length(cfg: CompressionConfig, prompt_len: int, seen: int, at_prefill: bool) -> int:
    """The length a per-layer schedule is read at in a check after ``seen`` tokens: the prompt's (the
    budgets of the prompt's end are kept while decoding), or while decoding under
    ``decode_compression_ratio`` the tokens seen (``restkv.strategies.decoding.decoding_budgets``)."""
    if at_prefill or cfg.get("decode_compression_ratio") is None:
        return prompt_len
    return seen


def layer_budget(cfg: CompressionConfig, budget: int, prompt_len: int, layer: int, layers: int) -> int:
    """Entries each KV head of attention layer ``layer`` (of ``layers``) keeps at ``budget`` in an
    eviction whose schedule is read at ``prompt_len`` (``schedule_length``), as ``restkv.configure``
    shares it among the layers."""
    if not per_layer(cfg):
        return budget
    return layer_budgets(cfg, layers, prompt_len, budget)[layer]


def largest(cfg: CompressionConfig, budget: int, held: int = UNBOUNDED) -> int:
    """Entries per KV head, on average over its heads, of the layer that keeps the most at ``budget``,
    from the config alone: ``budget``; HeadKV's table's largest layer average; PyramidKV's first layer at
    most ``window + ceil(2 (B - window) - (B - window) / beta)``; ``layer_ratios``' and LU-KV's largest
    over every prompt of at most ``held`` entries (``lukv_largest``); ``UNBOUNDED`` for ``DEFERRED``."""
    if deferred(cfg):
        return UNBOUNDED
    if cfg.get("head_budget") == "lukv":
        return lukv_largest(cfg, budget, held)
    most = budget
    if cfg.get("head_budget") == "headkv":
        table = head_table(cfg)
        most = cfg.window_size + -(-int(table.sum(-1).max()) // table.shape[-1])
    if cfg.get("layer_ratios") is not None:
        return max(ratio_budgets(cfg, held))  # its layers' budgets over a prompt of ``held``
    if per_layer(cfg):
        base = budget - cfg.window_size
        most = max(most, cfg.window_size + math.ceil(2 * base - base / cfg.beta))
    return most


def layer_table(cfg: CompressionConfig, layer: int, device):
    """HeadKV's counts [Hkv] or LU-KV's curve [99, Hkv] of attention layer ``layer`` on ``device``, or None
    for other configs."""
    if cfg.get("head_budget") == "headkv":
        return head_table(cfg)[layer].to(device)
    if cfg.get("head_budget") == "lukv":
        return head_table(cfg)[:, layer].to(device)
    return None


def most_kept(cfg: CompressionConfig, budget: int, max_len: int) -> int:
    """Entries per KV head, on average over every layer and head, a request keeps at most over prompts of
    up to ``max_len`` entries: ``budget`` where the layers and heads share it (uniform, AdaKV, HeadKV,
    PyramidKV, a threshold, a budget shared across layers), else the largest layer's bound over those
    prompts (LU-KV's curve, ``layer_ratios``: ``largest``), at most ``max_len``."""
    if cfg.get("head_budget") == "lukv" or cfg.get("layer_ratios") is not None:
        return min(max_len, largest(cfg, budget, max_len))
    return min(max_len, budget)


def lukv_kept(cfg: CompressionConfig, budget: int, prompt_len: int) -> int:
    """Entries LU-KV's heads keep at the prompt's end, summed over every layer and head (window included,
    ``lukv_sizes`` of each layer at its budget over ``prompt_len`` entries, as the worker selects)."""
    curve, w = head_table(cfg), cfg.window_size
    layers = curve.shape[1]
    budgets = layer_budgets(cfg, layers, prompt_len, budget) if per_layer(cfg) else [budget] * layers
    length = torch.tensor([prompt_len])
    return sum(int((lukv_sizes(curve[:, i], length, b, w) + w).sum()) for i, b in enumerate(budgets))


def lukv_largest(cfg: CompressionConfig, budget: int, held: int) -> int:
    """Entries per KV head, on average over its heads, that LU-KV's largest layer keeps at ``budget`` over
    any prompt of at most ``held`` entries (``held`` with PyramidKV's layer budgets, or ``UNBOUNDED``).
    A prompt of L entries reads the curve's row ``round(100 (1 - B / L)) - 1``; over the lengths of one
    row a layer's total grows with L, so each row's last length holding at most ``held`` gives its largest
    (``lukv_sizes`` there, as the worker selects); a prompt within the budget keeps all it holds."""
    if held >= UNBOUNDED or per_layer(cfg):
        return held
    curve, w = head_table(cfg), cfg.window_size
    most = min(held, budget)
    if held <= budget:
        return most
    lengths = torch.arange(budget + 1, held + 1, dtype=torch.float64)
    rows = ((1.0 - budget / lengths) * 100).round().long().sub(1).clamp(0, 98)
    last = torch.zeros(99, dtype=torch.float64).scatter_reduce(0, rows, lengths, "amax")
    last = last[last > 0].long()  # [rows] each row's last length
    for layer in range(curve.shape[1]):
        kept = lukv_sizes(curve[:, layer], last, budget, w) + w  # [rows, Hkv]
        most = max(most, -(-int(kept.sum(-1).max()) // kept.shape[-1]))
    return most


def mean_kept(cfg: CompressionConfig, budget: int, prompt_len: int, layers: int) -> int:
    """Entries per KV head a request keeps at ``budget``, on average over its ``layers`` layers and their
    heads, from the config alone (rounded up): ``budget`` where a layer's heads share ``Hkv * budget``
    (AdaKV) or keep ``budget`` each; HeadKV's table's mean; PyramidKV's schedule's mean over its layers
    (``layers * budget`` in all, uniform for a prompt within the budget); LU-KV's counts from its
    curve at ``prompt_len`` (``lukv_kept``); ``UNBOUNDED`` for ``DEFERRED`` (measured by the worker)."""
    if deferred(cfg):
        return UNBOUNDED
    if cfg.get("head_budget") == "lukv":
        heads = head_table(cfg).shape[1] * head_table(cfg).shape[2]
        return -(-lukv_kept(cfg, budget, prompt_len) // heads)
    if cfg.get("head_budget") == "headkv":
        table = head_table(cfg)
        return cfg.window_size + -(-int(table.sum()) // table.numel())
    if per_layer(cfg):
        return -(-sum(layer_budgets(cfg, layers, prompt_len, budget)) // layers)
    return budget


def layers_of(cfg: CompressionConfig) -> int:
    """The model's attention layers, as ``bind_model`` read them."""
    if cfg not in _LAYERS:
        raise RuntimeError("restkv.vllm: a per-layer budget before settings.bind_model read the model")
    return _LAYERS[cfg]


def room(cfg: CompressionConfig, budget: int, block_size: int, prompt_len: int, decoding: bool = False) -> int:
    """Entries a kept set is counted at, from the config alone (0: ``budget``, every head and layer
    keeping as many): where heads or layers keep their own counts (``per_head``), their mean over
    every layer and head and ``block_size`` more (``restkv.vllm.heads.equivalent_length``: any split
    over the layers' and heads' pages fits), the bound of the count the worker sends once the heads
    kept theirs (``heads.exact_length``). ``decoding``: a check after the prompt's end, where LU-KV's
    counts follow each layer's widest head (not known here): ``UNBOUNDED``, all it holds. Under tensor
    parallelism where the heads' split is across ranks (``sized_across_heads``), each rank's heads may
    hold all of it: the mean times the ranks."""
    if not per_head(cfg):
        return 0
    if decoding and cfg.get("head_budget") == "lukv":
        return UNBOUNDED
    layers = layers_of(cfg) if per_layer(cfg) else 1
    return equivalent_length(min(UNBOUNDED, rank_share(cfg) * mean_kept(cfg, budget, prompt_len, layers)), block_size)


def rank_share(cfg: CompressionConfig) -> int:
    """How many times the mean over every head one rank's heads may hold: the ranks where the heads' split is
    across them (``sized_across_heads``: all of it may be one rank's), else 1."""
    return _RANKS.get(cfg, 1) if sized_across_heads(cfg) else 1


def sized_across_heads(cfg: CompressionConfig) -> bool:
    """A head's count depends on the other heads' (AdaKV and HeadKV share a layer's budget, LU-KV rounds
    a layer's counts over its heads, ``DEFERRED`` shares one over every layer's): under tensor parallelism
    every rank gathers every head's scores and keeps its own heads' part (``ranks``)."""
    return deferred(cfg) or shares_heads(cfg) or cfg.get("head_budget") == "lukv"


def mixes_heads(cfg: CompressionConfig) -> str | None:
    """Why a head's scores depend on the other heads (tensor parallelism gives each rank some of them),
    or None (a split of the budget across heads is gathered over the ranks: ``sized_across_heads``)."""
    if cfg.scorer.scorer == "restkv.methods.kvcompose" and cfg.get("add_mean_across_heads"):
        return "KVCompose's add_mean_across_heads adds every KV head's mean to each head's scores"
    if cfg.scorer.scorer == "restkv.methods.random" or cfg.get("indicator") == "random":
        return "random scores are drawn for every head at once"
    if cfg.get("chunk_size"):
        return "ChunkKV ranks chunks by the score summed over every head"
    return None


def query_rows(cfg: CompressionConfig) -> int:
    """The most recent queries an eviction reads: the window's (ReST-KV: ``query_window`` when
    longer). A ``SUMMED`` method's prefill reads every query, as chunk scores (``summed``)."""
    return max(cfg.window_size, cfg.get("query_window") or 0)


def summed(cfg: CompressionConfig) -> bool:
    """Its prefill score is a sum over every query of the prompt, added up chunk by chunk."""
    return cfg.scorer.scorer in SUMMED


@dataclass(frozen=True)
class Eviction:
    """What one request does at the end of one engine step.

    ``held`` entries are in its blocks once the step's tokens are written; it keeps ``budget`` of
    them. ``fresh``: the kept entries go to ``kept_blocks`` new blocks allocated after the held ones
    (its first eviction with prefix caching on: the held blocks may be shared with other requests
    or offered as cache hits, so they are left whole and released); else they are written over its
    first ``kept_blocks`` blocks (its blocks are its own).
    """

    held: int
    """Entries in the request's blocks once the step's tokens are written."""
    budget: int
    """Entries it keeps."""
    fresh: bool
    """The kept entries go to new blocks after the held ones (else over its first blocks)."""
    block_size: int
    """Entries per block."""
    room: int = 0
    """Entries the kept set is counted at (0: ``budget``; ``settings.room``): with per-head budgets the mean
    over every layer and head and ``block_size`` more, whatever the heads' split, until the worker's count
    (``measured``); at most ``held + block_size``."""
    measured: bool = False
    """Its kept count is the worker's (``per_head``: from its heads' lengths, ``heads.exact_length``):
    ``room`` is its bound until ``kept`` gives it."""

    @property
    def counted(self) -> int:
        """Entries the request is counted at once it evicted."""
        return self.room or self.budget

    @property
    def held_blocks(self) -> int:
        """Blocks the held entries fill."""
        return -(-self.held // self.block_size)

    @property
    def kept_blocks(self) -> int:
        """Blocks the kept entries fill."""
        return -(-self.counted // self.block_size)

    @property
    def first_kept_block(self) -> int:
        """Index in the request's blocks of the first block the kept entries go to."""
        return self.held_blocks if self.fresh else 0

    @property
    def slots(self) -> int:
        """Token slots the request needs during the step: its held blocks and, kept in fresh
        blocks, those too; else at least its kept blocks (per-head budgets can count more)."""
        if self.fresh:
            return (self.held_blocks + self.kept_blocks) * self.block_size
        return max(self.held_blocks, self.kept_blocks) * self.block_size

    @property
    def evicted(self) -> int:
        """Entries it removes: its offset (logical positions - entries held) grows by as many (with
        per-head budgets counted at ``room``: negative where that exceeds what it held)."""
        return self.held - self.counted

    def kept(self, counted: int) -> "Eviction":
        """The eviction once the worker measured its kept count (``counted`` entries)."""
        if not 0 < counted <= self.room:
            raise RuntimeError(f"restkv.vllm: a kept count of {counted} entries, outside 1 .. {self.room}")
        return replace(self, room=counted, measured=False)

    def cut(self, blocks: list) -> list:
        """Keep, in place, the ``kept_blocks`` of ``blocks`` (a request's block ids, or a copy of its
        block-table row) from ``first_kept_block``; return the others, which go back to the pool."""
        first, count = self.first_kept_block, self.kept_blocks
        gone = blocks[:first] + blocks[first + count :]
        blocks[:] = blocks[first : first + count]
        return gone


def eviction(
    cfg: CompressionConfig,
    computed: int,
    scheduled: int,
    prompt_len: int,
    offset: int,
    caching: bool,
    block_size: int,
    evicted: bool | None = None,
) -> Eviction | None:
    """The request's eviction at the end of a step that computes its tokens ``computed`` ..
    ``computed + scheduled - 1`` (logical positions), or None.

    Eviction is checked once a step has computed the whole prompt (``prompt_len``) and then every
    ``decode_interval`` tokens after it (logical counts ``prompt_len + m * decode_interval``), as
    restkv's transformers path does; a request evicts at a check when it holds more than its budget:
    ``max_capacity_prompt``, or while decoding under ``decode_compression_ratio`` r
    ``max(window_size + 1, int(n (1 - r)))`` of the n tokens it has seen; a threshold's
    (``head_budget="threshold"``) at every check, as ``restkv.configure`` selects; once a request's heads
    hold their own pages (``per_head``, ``evicted``), at every check too: a layer's widest head may hold
    more than the budget where the request holds fewer, and the worker keeps all of a layer that fits, as
    ``configure()`` decides layer by layer. ``offset``: entries it evicted before (logical - held);
    ``caching``: prefix caching is on; ``evicted``: it evicted before (default: ``offset != 0``).
    """
    end = computed + scheduled
    if not _checks_between(computed, end, prompt_len, cfg.get("decode_interval") or 0):
        return None
    held = end - offset
    at_prefill = computed < prompt_len
    budget = budget_at(cfg, end, at_prefill)
    evicted = offset != 0 if evicted is None else evicted
    length = schedule_length(cfg, prompt_len, end, at_prefill)
    if not evicts(cfg, held, budget, length, at_prefill, evicted):
        return None
    counted = room(cfg, budget, block_size, length, decoding=not at_prefill)
    counted = counted and min(counted, held + block_size)  # no head keeps more than it holds
    fresh = caching and not evicted and not deferred(cfg)  # ``uncached``: its blocks are its own
    return Eviction(held, budget, fresh, block_size, counted, per_head(cfg))


def evicts(cfg: CompressionConfig, held: int, budget: int, length: int, at_prefill: bool, evicted: bool) -> bool:
    """Whether a check that finds ``held`` entries evicts, as ``restkv.configure`` decides: at the prompt's
    end ``prompt_evicts``; while decoding, some layer holds more than its budget (``budget``, or the
    smallest layer's of a ``per_layer`` config, its schedule read at ``length``) or a threshold selects
    (``fits``); and once its heads hold their own pages (``per_head``, ``evicted``) at every check, since
    a layer's widest head is not known here: the worker keeps all of a layer that fits."""
    if at_prefill:
        return prompt_evicts(cfg, held)
    if evicted and per_head(cfg):
        return True
    smallest = min(layer_budgets(cfg, layers_of(cfg), length, budget)) if per_layer(cfg) else budget
    return not fits(cfg, held, smallest)


def _checks_between(computed: int, end: int, prompt_len: int, interval: int) -> bool:
    """Whether a check point (``prompt_len``, then every ``interval`` tokens) is in (computed, end]."""
    if end < prompt_len:
        return False
    if computed < prompt_len:
        return True
    return interval > 0 and (end - prompt_len) // interval > (computed - prompt_len) // interval


def most_budget(cfg: CompressionConfig, seen: int) -> int:
    """The largest budget of any check up to ``seen`` tokens: ``max_capacity_prompt``, or under
    ``decode_compression_ratio`` the decoding budget of ``seen`` tokens where larger."""
    return max(cfg.max_capacity_prompt, budget_at(cfg, seen, at_prefill=False))


def budget_at(cfg: CompressionConfig, seen: int, at_prefill: bool) -> int:
    """Entries kept per KV head and layer at a check after ``seen`` tokens (window included)."""
    ratio = cfg.get("decode_compression_ratio")
    if at_prefill or ratio is None:
        return cfg.max_capacity_prompt
    return max(cfg.window_size + 1, max(1, int(seen * (1 - ratio))))


def hit_limit(cfg: CompressionConfig, num_tokens: int) -> int:
    """The most tokens of a request that a prefix-cache hit may provide: an eviction reads the
    queries of its last ``query_rows`` positions (and a ``SUMMED`` method's prefill every query),
    which only a computed token has; an ``uncached`` request takes none. ``num_tokens``: what the
    request's prefill computes up to."""
    if (summed(cfg) and prompt_evicts(cfg, num_tokens)) or uncached(cfg, num_tokens):
        return 0
    return max(0, num_tokens - query_rows(cfg))


def extra_blocks(cfg: CompressionConfig, max_model_len: int, block_size: int) -> int:
    """Blocks a request can hold beyond ``max_model_len``'s: the kept ones during a first eviction
    with prefix caching on (under tensor parallelism, as many as ``room`` may count: ``rank_share``)."""
    most = (
        max_model_len
        if cfg.get("decode_compression_ratio") is not None
        else cfg.max_capacity_prompt
    )
    largest_kept = min(UNBOUNDED, rank_share(cfg) * largest(cfg, most, max_model_len))
    kept = max(most, equivalent_length(largest_kept, block_size) if per_head(cfg) else 0)
    return -(-min(kept, max_model_len + block_size) // block_size)
