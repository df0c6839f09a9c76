"""The plugin's configuration and the rule both of vLLM's sides apply: no vLLM import here.

``RESTKV_VLLM`` (a JSON object) holds the knobs of ``restkv.configure`` (``method``,
``max_capacity_prompt``, ``window_size``, the method's own); vLLM's own
``additional_config={"restkv": {...}}`` takes precedence. Unset, the plugin changes nothing.
"""

from __future__ import annotations

import json
import os

from ..config import CompressionConfig

ENV = "RESTKV_VLLM"

# knob -> (whether its value can run, what vLLM needs): vLLM's block table holds one entry count per
# request
_NEEDED = {
    "layer_budget": (lambda v: v == "uniform", "'uniform' (every layer keeps as many entries)"),
    "head_budget": (lambda v: v == "uniform", "'uniform' (every KV head keeps as many entries)"),
    "gqa_agg": (lambda v: v != "none", "a reduction to one kept set per KV head, not 'none'"),
    "max_capacity_prompt_ratio": (lambda v: v is None, "none: give max_capacity_prompt"),
    "quant_method": (
        lambda v: v is None,
        "none: vLLM holds the cache (its kv_cache_dtype quantizes)",
    ),
    "pruning_ratio": (lambda v: v is None, "none: vLLM's cache keeps every key channel"),
    "decode_interval": (lambda v: not v, "0: the plugin evicts at prefill only"),
}


def from_env(additional: dict | None = None) -> CompressionConfig | None:
    """The config the plugin runs (None: the plugin is off), validated; a bad one raises a one-line
    ValueError."""
    knobs = (additional or {}).get("restkv")
    if knobs is None:
        text = os.environ.get(ENV)
        if not text:
            return None
        try:
            knobs = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV} must be a JSON object of restkv knobs: {e}") from None
    if not isinstance(knobs, dict):
        raise ValueError(f"{ENV} must be a JSON object of restkv knobs; got {type(knobs).__name__}")
    cfg = CompressionConfig.from_kwargs(**knobs)
    check(cfg)
    return cfg


def check(cfg: CompressionConfig) -> None:
    """Raise a one-line ValueError for a config the plugin cannot run in vLLM."""
    if not cfg.evicts:
        raise ValueError(
            f"{ENV}: method {cfg.method} keeps every entry; unset {ENV} to run plain vLLM"
        )
    if cfg.scorer.replays:
        raise ValueError(
            f"{ENV}: method {cfg.method} scores with forward passes of its own after the prefill; "
            "the vLLM plugin runs methods that read the prefill's queries and keys only"
        )
    if cfg.scorer.reads_hidden:
        raise ValueError(
            f"{ENV}: method {cfg.method} scores the layers' hidden states, which vLLM's attention "
            "backend does not see"
        )
    if cfg.method == "expected_attention":
        raise ValueError(
            f"{ENV}: method expected_attention needs the queries before RoPE, which vLLM's "
            "attention backend does not see"
        )
    for name, (runs, needed) in _NEEDED.items():
        if name in cfg and not runs(cfg[name]):
            raise ValueError(f"{ENV}: {name}={cfg[name]!r} cannot run in vLLM; it needs {needed}")


def kept_entries(computed_before: int, scheduled: int, prompt_len: int, budget: int) -> int | None:
    """Entries a request holds after this step, if it evicts in this step; None if it does not.

    A request evicts in the step that computes its whole sequence from the start (its prefill, or
    the re-prefill of a preempted request) when that sequence is longer than the budget. The
    scheduler (which frees the blocks) and the worker (which rewrites the cache) both decide with
    this rule.
    """
    if computed_before != 0 or scheduled < prompt_len or scheduled <= budget:
        return None
    return budget
