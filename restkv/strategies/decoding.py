"""Eviction while decoding: its knob (``decode_interval``) and the combinations it refuses.

A strategy for any scorer and any budgets; the eviction itself is ``restkv.eviction.decode``.
"""

from __future__ import annotations

from ..knobs import Knob

KNOBS = (
    Knob(
        "decode_interval",
        0,
        "evict again every this many new tokens while decoding, observed by the "
        "window_size most recent queries, so each head holds at most its budget + decode_interval "
        "entries; 0: evict at prefill only",
        check=lambda n: n >= 0,
        rule=">= 0",
        stage="select",
    ),
)


def check(values: dict) -> None:
    if values.get("decode_interval") and values.get("quant_method"):
        raise ValueError("decode_interval needs full-precision kept entries (quant_method none)")
    if values.get("decode_interval") and values.get("pruning_ratio") is not None:
        raise ValueError(
            "decode_interval needs full keys to score again: pruning_ratio (ThinK) must be none with it"
        )
    if values.get("decode_interval") and values.get("layer_budget") == "global":
        raise ValueError(
            "decode_interval needs a budget per layer: layer_budget 'uniform' or 'pyramid', not 'global'"
        )
