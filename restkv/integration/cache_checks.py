"""Which caches eviction goes into: the model's own dynamic layers, or the kept entries' layers; any other
(static, quantized, offloaded) is refused before the layer's forward, with what to do instead."""

from __future__ import annotations

import transformers.cache_utils as cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from ..cache import KeptLayer, VarlenLayer

# transformers' quantized cache layers (transformers 5.17 has no Fp8QuantizedLayer)
QUANTIZED_LAYERS = tuple(
    getattr(cache_utils, name)
    for name in ("QuantizedLayer", "Fp8QuantizedLayer")
    if hasattr(cache_utils, name)
)
# The cache layers a prefill is evicted from: the model's own dynamic layers.
PREFILL_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def check_cache(state, cache, layer_idx: int) -> None:
    """Before a layer's forward (``state`` its ``LayerState``): raise if eviction cannot go into the ``cache`` the caller passed (a static,
    quantized or offloaded cache), so that no full cache is used silently; a fresh cache clears the kept positions."""
    if cache is None or not state.plan.evicts:
        return
    if cache.get_seq_length(layer_idx) == 0:
        state.kept = None  # a new prefill
    if not state.plan.cfg.evicts:
        return
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(
            f"past_key_values: restkv evicts into the model's DynamicCache, not a {type(cache).__name__}: "
            "pass no cache or a DynamicCache"
        )
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    kind = type(layer) if layer is not None else getattr(cache, "layer_class_to_replicate", None)
    if getattr(cache, "offloading", False) or not (
        kind in PREFILL_LAYERS or isinstance(layer, (KeptLayer, VarlenLayer))
    ):
        raise ValueError(unsupported_cache(cache, kind))


def unsupported_cache(cache, kind) -> str:
    """Why eviction cannot go into ``cache`` (layers of type ``kind``), and what to do instead."""
    offloaded = bool(getattr(cache, "offloading", False))
    what = f"{type(cache).__name__} ({getattr(kind, '__name__', kind)} layers{', offloaded' if offloaded else ''})"
    if offloaded:
        fix = (
            "the kept entries are few: pass no cache (nor cache_implementation='offloaded'), or offload the "
            "model's layers instead (--device_map)"
        )
    elif isinstance(kind, type) and issubclass(kind, QUANTIZED_LAYERS):
        fix = (
            "eviction quantizes the kept entries itself: pass no cache and set quant_method "
            "(configure(model, ..., quant_method='quanto' or 'hqq', nbits=...))"
        )
    elif isinstance(kind, type) and issubclass(kind, StaticLayer):
        fix = (
            "a static cache holds a fixed number of entries; pass no cache (or a DynamicCache), "
            "and do not set cache_implementation='static'"
        )
    else:
        fix = "pass no cache or a DynamicCache"
    return f"past_key_values: restkv evicts into the model's DynamicCache, not a {what}: {fix}"
