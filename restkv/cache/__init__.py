"""Cache layers that hold kept entries: ``Kept`` (the contract), the dense, packed per-head, ThinK-pruned
and quantized layers, ``cache_layer`` (which one holds a selection) and ``memory_report``."""

from .dense import CompressedLayer, KeptLayer
from .kept import HeldSizes, Kept, appended_positions, newest_positions, stack_samples
from .layers import cache_layer
from .packed import VarlenLayer
from .pruned import PrunedLayer, PrunedVarlenLayer
from .quantized import quantized_layer
from .report import held_bytes, memory_report, tensor_bytes
from .segments import SegmentIndex, masked_attention, varlen_attention

__all__ = [
    "CompressedLayer",
    "HeldSizes",
    "Kept",
    "KeptLayer",
    "PrunedLayer",
    "PrunedVarlenLayer",
    "SegmentIndex",
    "VarlenLayer",
    "appended_positions",
    "cache_layer",
    "held_bytes",
    "masked_attention",
    "memory_report",
    "newest_positions",
    "quantized_layer",
    "stack_samples",
    "tensor_bytes",
    "varlen_attention",
]
