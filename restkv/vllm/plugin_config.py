"""The plugin's config: read from the environment or the engine (``from_env``), checked against what
vLLM can run (``check``), and what it asks of the rules (``per_head``, ``deferred``, ``summed``, ...). No vLLM
import here.

``RESTKV_VLLM`` (a JSON object) holds the knobs of ``restkv.configure`` (``method``,
``max_capacity_prompt``, ``window_size``, ``decode_interval``, the method's own); an engine's
``additional_config={"restkv": {...}}`` (``--additional-config`` of ``vllm serve``) takes precedence
over it. Neither set: the plugin changes nothing.
"""

from __future__ import annotations

import json
import os

from ..config import CompressionConfig
from ..strategies.budgets import keeps_prompt

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
