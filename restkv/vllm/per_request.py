"""A request's own knobs (no vLLM import): ``SamplingParams(extra_args={"restkv": {...}})`` in Python,
``"vllm_xargs": {"restkv": "<the same object as JSON text>"}`` in the OpenAI API (whose extra arguments
are flat), or ``"off"`` for either.

The engine's config (``settings.from_env``) is the default:

- no ``restkv`` entry: the request runs the engine's config;
- knobs without ``method`` (or with the engine's): the engine's knobs with these changed;
- another ``method``: that method's defaults, with the engine's ``CARRIED`` knobs (budget, window,
  decode interval) where the request does not give them;
- ``"off"`` or ``method="fullkv"``: the request keeps its whole cache.

The front end (``hooks.requests``: a bad request is answered with HTTP 400 before the engine sees it),
the scheduler and every worker resolve a request's knobs with ``resolve``, from the same numbers, so they
agree without a message. A request is served only as far as the running engine was started for it
(``refusal``, one line): besides what ``settings.check`` refuses for an engine, a method whose heads'
counts depend on other heads under tensor parallelism, per-head or per-layer budgets on an engine of
uniform ones (its layers were hooked without the heads' pages), more blocks per request than the
block table was widened for, and any term of the plugin's own memory above the engine's
(``memory.fixed_bytes``, ``memory.per_token``: vLLM's KV pool was sized leaving out the engine's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..config import CompressionConfig
from . import memory, settings

KEY = "restkv"
"""The request's entry in ``SamplingParams.extra_args`` (``vllm_xargs`` in the OpenAI API)."""
FIELD = "extra_args['restkv']"
OFF = "off"
CARRIED = ("max_capacity_prompt", "window_size", "decode_interval")
"""The engine's knobs a request of another method keeps unless it gives its own."""


@dataclass(frozen=True)
class Engine:
    """What a request's knobs are checked against: the engine's config (None: the plugin is off),
    one rank's model and vLLM's sizes."""

    cfg: CompressionConfig | None
    model: memory.Model
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    tensor_parallel: int = 1
    replicated: bool = False  # the ranks do not split the KV heads evenly (vLLM replicates them)
    resolved: dict = field(default_factory=dict, compare=False)  # knobs as JSON -> config or None

    def terms(self, cfg: CompressionConfig) -> dict:
        """The plugin's memory for ``cfg`` term by term (bytes; ``memory``)."""
        sizes = (self.max_num_seqs, self.max_model_len, self.max_num_batched_tokens, self.block_size)
        return {**memory.fixed_bytes(cfg, self.model, *sizes), "share per pooled token": memory.per_token(cfg, self.model)}


def knobs_of(extra_args) -> object:
    """The request's restkv knobs in its ``extra_args`` (None: it gives none)."""
    return (extra_args or {}).get(KEY)


def resolve(engine: Engine, knobs) -> CompressionConfig | None:
    """The config a request with ``knobs`` runs (None: it keeps its whole cache); a bad one, or one
    this engine cannot serve, raises a one-line ValueError naming ``FIELD``."""
    if knobs is None:
        return engine.cfg
    text = knobs if isinstance(knobs, str) else json.dumps(knobs, sort_keys=True, default=str)
    if text not in engine.resolved:
        cfg = parse(engine, knobs)
        why = None if cfg is None else refusal(engine, cfg)
        if why:
            raise ValueError(f"{FIELD}: {why}")
        engine.resolved[text] = cfg
    return engine.resolved[text]


def parse(engine: Engine, knobs) -> CompressionConfig | None:
    """``knobs`` over the engine's config, validated as ``restkv.configure`` and ``settings.check``
    validate them (None: ``"off"``)."""
    if isinstance(knobs, str) and knobs.strip() != OFF:
        try:
            knobs = json.loads(knobs)
        except json.JSONDecodeError as e:
            raise ValueError(f"{FIELD} must be {OFF!r} or a JSON object of restkv knobs: {e}") from None
    if knobs == OFF or (isinstance(knobs, str) and knobs.strip() == OFF):
        return None
    if not isinstance(knobs, dict):
        raise ValueError(f"{FIELD} must be {OFF!r} or an object of restkv knobs; got {type(knobs).__name__}")
    if knobs.get("method") == "fullkv":
        return None
    if engine.cfg is None:
        raise ValueError(
            f"{FIELD}: this engine runs without restkv (neither additional_config['restkv'] nor "
            f"{settings.ENV} set); start it with the plugin's config to evict per request"
        )
    base = engine.cfg.as_dict()
    if knobs.get("method", engine.cfg.method) != engine.cfg.method:
        base = {k: base[k] for k in CARRIED if k in base}
    try:
        cfg = CompressionConfig.with_defaults(base, **knobs)
        settings.check(cfg, FIELD)
        m = engine.model
        settings.bind_model(cfg, m.layers, m.heads * m.ranks, m.kv_heads * m.ranks, m.ranks)
    except (ValueError, TypeError) as e:
        message = str(e)
        raise ValueError(message if message.startswith(FIELD) else f"{FIELD}: {message}") from None
    return cfg


def refusal(engine: Engine, cfg: CompressionConfig) -> str | None:
    """Why this engine cannot run a request of ``cfg`` (one line), or None."""
    mixes = settings.mixes_heads(cfg)
    if engine.tensor_parallel > 1 and mixes:
        return f"{mixes}, and this engine gives each of its {engine.tensor_parallel} ranks some heads"
    if engine.replicated and settings.sized_across_heads(cfg):
        return (
            f"{settings.budget_knobs(cfg)} splits a budget across the KV heads, which this engine's "
            f"{engine.tensor_parallel} ranks do not split evenly"
        )
    if settings.per_head(cfg) and not settings.per_head(engine.cfg):
        return (
            f"{settings.budget_knobs(cfg)} needs an engine started with per-head or per-layer budgets; "
            f"this one runs uniform ones ({engine.cfg.method})"
        )
    need, have = (settings.extra_blocks(c, engine.max_model_len, engine.block_size) for c in (cfg, engine.cfg))
    if need > have:
        return (
            f"max_capacity_prompt={cfg.max_capacity_prompt} needs {need} blocks per request past max_model_len's, "
            f"over the {have} the engine's max_capacity_prompt={engine.cfg.max_capacity_prompt} gives"
        )
    rows, ring = settings.query_rows(cfg), settings.query_rows(engine.cfg)
    if rows > ring:
        return (
            f"window_size={cfg.window_size} reads a request's {rows} most recent queries; the engine keeps "
            f"{ring} (its window_size): start it with the widest window its requests use"
        )
    theirs = engine.terms(engine.cfg)
    for term, n in engine.terms(cfg).items():
        if n > theirs[term]:
            return (
                f"{term} for {cfg.method}: {n} B of the plugin's memory, over the {theirs[term]} B the engine's "
                f"config ({engine.cfg.method}) left out of the KV pool: start the engine with the heaviest knobs "
                "its requests use"
            )
    return None
