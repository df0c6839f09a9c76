"""The knob declarations a config is resolved from: the general knobs, the strategies' and the methods',
their other names (``ALIASES``), the named knob sets (``PRESETS``), and the table of every knob."""

from __future__ import annotations

import functools

from ..knobs import Knob
from ..methods import METHODS, REGISTRY
from ..strategies import STRATEGIES, think

QUANT_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
QUANT_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
_QUANTIZED = {"quant_method": tuple(QUANT_BITS)}

# Read by every run (fullkv ignores the budget and window).
GENERAL = (
    Knob(
        "max_capacity_prompt",
        512,
        "entries kept per KV head per layer after prefill (the budget B), window included",
        check=lambda b: b >= 1,
        rule=">= 1 and larger than window_size",
        when={"max_capacity_prompt_ratio": (None,)},
    ),
    Knob(
        "max_capacity_prompt_ratio",
        None,
        "the budget as a fraction of each sample's prompt instead: "
        "round(L * ratio) entries (window included, at least window_size + 1)",
        rule="in (0, 1]",
        nullable=True,
        of=float,
    ),
    Knob(
        "window_size",
        32,
        "the last prompt tokens: always kept, and their queries observe the prefix",
        rule=">= 1",
    ),
    Knob(
        "quant_method",
        None,
        "hold the kept entries in transformers' quantized cache layer: quanto (2/4 "
        "bits) or hqq (1/2/3/4/8 bits); none: full precision",
        choices=tuple(QUANT_BITS),
        nullable=True,
    ),
    Knob("nbits", 4, "bits per quantized key/value element", when=_QUANTIZED),
    Knob(
        "residual_length",
        32,
        "decoded entries kept in full precision before they are quantized in one go",
        rule=">= 0",
        when=_QUANTIZED,
    ),
    Knob(
        "q_group_size",
        64,
        "quantization group size",
        rule=">= 1",
        when=_QUANTIZED,
    ),
) + think.KNOBS
# read by every method that evicts
EVICTION = tuple(knob for strategy in STRATEGIES for knob in strategy.KNOBS)
# Other names of a knob (the original's flags): name -> (knob, {value: knob's value}).
ALIASES = {"ss": ("pooling", {p: p for p in ("none", "avgpool", "maxpool", "adaptive")})}
for _part in (*STRATEGIES, *(m.module for m in REGISTRY.values())):
    ALIASES.update(getattr(_part, "ALIASES", {}))

# Named knob sets. "paper": ReST-KV exactly as published (ICLR 2026 paper and its code).
PRESETS = {
    "paper": dict(
        method="restkv",
        indicator="reconstruction",
        window_size=32,
        kernel_size=5,
        pooling="adaptive",
        scale=2000.0,
        temporal="ema",
        alpha=0.3,
        metric_mode="after",
        use_wo=True,
        tau=1.0,
    ),
}


def declared(method: str) -> dict:
    """Every knob ``method`` may read, by name (with the registry's defaults)."""
    m = REGISTRY[method]
    knobs = GENERAL + (EVICTION + m.knobs if m.evicts else ())
    out = {k.name: k for k in knobs}
    for name, value in m.defaults.items():
        out[name] = out[name].but(default=value)
    return out


def all_knobs() -> dict:
    """Every declared knob by name -> list of ``(owners, Knob)`` (owners: the methods that read that version)."""
    out: dict = {}
    for method in METHODS:
        for knob in declared(method).values():
            versions = out.setdefault(knob.name, [])
            for owners, k in versions:
                if k == knob:
                    owners.append(method)
                    break
            else:
                versions.append(([method], knob))
    return out


@functools.lru_cache(maxsize=None)
def _known() -> frozenset:
    return frozenset(all_knobs()) | frozenset(ALIASES) | {"method"}


def readers(owners) -> str:
    """Methods in few words: ``all``, ``all but rkv, triattention`` (fewer left out than named), else their
    names."""
    left_out = [m for m in METHODS if m not in owners]
    if not left_out:
        return "all"
    return f"all but {', '.join(left_out)}" if len(left_out) < len(owners) else ", ".join(owners)


def _allowed(values, sep: str) -> str:
    """A knob's allowed values in the table: most of the methods as ``any method but fullkv, ...``, any other
    values joined by ``sep``."""
    if len(values) > 2 * len(METHODS) // 3 and set(values) <= set(METHODS):
        return readers(values).replace("all", "any method", 1)
    return sep.join(map(str, values))


def knob_table() -> str:
    """A markdown table of every knob: name, default, allowed values, who reads it, what it does."""
    rows = ["| knob | default | values | read by | meaning |", "|---|---|---|---|---|"]
    for name, versions in all_knobs().items():
        for owners, k in versions:
            who = readers(owners)
            cond = f" (when {k.condition(say=lambda v: _allowed(v, ' or '))})" if k.when else ""
            values = _allowed(k.choices, " \\| ") if k.choices else (k.rule or k.kind.__name__)
            rows.append(f"| `{name}` | `{k.default}` | {values} | {who}{cond} | {k.help} |")
    return "\n".join(rows)
