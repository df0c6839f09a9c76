"""Eviction while decoding: its knobs (``decode_interval``, ``decode_compression_ratio``) and the
combinations it refuses.

A strategy for any scorer and any budgets; the eviction itself is ``restkv.eviction.decode``.

``decode_compression_ratio`` r is kvpress's ``CompressionRatioDecodingPress``
(``kvpress/presses/compression_ratio_decoding_press.py``, its ``target_compression_ratio``, 0.5
there): each eviction while decoding keeps ``max(1, int(n (1 - r)))`` entries per KV head, n the
tokens the sample has seen so far (its newest position + 1, evicted ones included), instead of the
prefill's budget. Where restkv differs: n is each sample's own (kvpress: the batch's largest
position), the budget holds the window (at least ``window_size + 1``), and under
``layer_budget="pyramid"`` it is shared by the layers as the prefill's budget is. The prefill keeps
its own budget (``max_capacity_prompt`` or ``max_capacity_prompt_ratio``; kvpress's press leaves the
prefill whole).
"""

from __future__ import annotations

from ..knobs import Knob
from .budgets import layer_budgets

KNOBS = (
    Knob(
        "decode_interval",
        0,
        "evict again every this many new tokens while decoding, observed by the "
        "window_size most recent queries, so each head holds at most its budget + decode_interval "
        "entries; 0: evict at prefill only",
        rule=">= 0",
        stage="select",
    ),
    Knob(
        "decode_compression_ratio",
        None,
        "with decode_interval: each eviction while decoding keeps max(1, int(n (1 - r))) "
        "entries per head of the n tokens seen so far (kvpress's CompressionRatioDecodingPress) "
        "instead of the prefill's budget; None: the prefill's budget",
        rule="in [0, 1)",
        nullable=True,
        of=float,
        stage="select",
    ),
)


def check(values: dict) -> None:
    if values.get("decode_compression_ratio") is not None and not values.get("decode_interval"):
        raise ValueError(
            "decode_compression_ratio acts while decoding: it needs decode_interval > 0"
        )
    if values.get("decode_compression_ratio") is not None and values.get("layer_ratios"):
        raise ValueError("decode_compression_ratio and layer_ratios both set the budgets; give one")
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


def decoding_budgets(cfg, seen, num_layers: int, layer: int) -> list[int]:
    """The budget of each sample (window included) at an eviction while decoding, from the tokens
    ``seen`` (a list: per sample, its newest position + 1) under ``decode_compression_ratio``."""
    keep = [max(1, int(n * (1 - cfg.decode_compression_ratio))) for n in seen]
    total = [max(cfg.window_size + 1, k) for k in keep]
    return [layer_budgets(cfg, num_layers, n, b)[layer] for n, b in zip(seen, total)]
