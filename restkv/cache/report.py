"""How much memory a cache holds: per layer, the bytes a full cache would hold and the bytes held."""

from __future__ import annotations

import torch


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside ``obj`` (tensors, quantized tensor subclasses, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name)) for name in names)
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def held_bytes(layer) -> int:
    """Bytes of the keys and values a cache layer stores (quantized parts included)."""
    extra = (
        "_quantized_keys",
        "_quantized_values",
        "pruned_keys",
        "channels",
    )  # quantized parts, ThinK's older keys
    parts = [layer.keys, layer.values, *(getattr(layer, name, None) for name in extra)]
    return sum(tensor_bytes(p) for p in parts)


def memory_report(cache) -> list[dict]:
    """Per layer of a cache after prefill/decoding: tokens seen, bytes a full cache would hold, bytes held."""
    rows = []
    for i, layer in enumerate(cache.layers):
        per_token = getattr(layer, "token_bytes", None)
        if per_token is None:  # an untouched full-precision layer
            b, hkv, _, d = layer.keys.shape
            per_token = b * hkv * d * 2 * layer.keys.element_size()
        rows.append(
            {
                "layer": i,
                "kind": type(layer).__name__,
                "tokens": layer.get_seq_length(),
                "full_bytes": layer.get_seq_length() * per_token,
                "held_bytes": held_bytes(layer),
            }
        )
    return rows
