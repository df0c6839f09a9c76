"""The kept entries in transformers' quantized cache layers (``quant_method``: quanto or hqq)."""

from __future__ import annotations

from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

from .dense import KeptLayer
from .kept import Kept


_QUANTIZED_BACKENDS = {"quanto": QuantoQuantizedLayer, "hqq": HQQQuantizedLayer}
_quantized_classes: dict[str, type] = {}


def _not_croppable(self, tokens_to_remove: int) -> None:
    raise ValueError("crop: a quantized cache (quant_method) cannot remove decoded entries")


def quantized_layer(
    kept: Kept, seen: int, method: str, nbits: int, residual_length: int, q_group_size: int
):
    """The kept entries held in transformers' quantized cache layer (``quanto`` or ``hqq`` backend).

    The kept prefill is quantized at once; decoded entries stay in full precision until
    ``residual_length`` of them gather, then join the quantized part (KIVI-style).
    """
    base = _QUANTIZED_BACKENDS[method]
    cls = _quantized_classes.setdefault(
        method,
        type(
            f"Compressed{base.__name__}",
            (KeptLayer, base),
            {"is_croppable": False, "crop": _not_croppable},
        ),
    )
    layer = cls(nbits=nbits, q_group_size=q_group_size, residual_length=residual_length)
    base.update(layer, kept.keys, kept.values)
    layer.keep(kept, seen)
    return layer
