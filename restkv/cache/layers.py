"""Which cache layer holds a layer's kept entries: dense, packed per head, ThinK-pruned or quantized."""

from __future__ import annotations

from torch import Tensor

from .dense import CompressedLayer
from .kept import HeldSizes, Kept
from .packed import VarlenLayer
from .pruned import PrunedLayer, PrunedVarlenLayer
from .quantized import quantized_layer


def cache_layer(
    kept: Kept, seen: int, cfg, channels: Tensor | None = None, sizes: HeldSizes | None = None
):
    """The cache layer that holds a layer's kept entries, or None when the full cache stays as it is.

    Quantized (``quant_method``), packed per head (per-head budgets with ``varlen``, or one kept set
    per query head) or dense; with ThinK's ``channels`` [b, H, c] the older keys hold only those
    channels (``restkv.cache.pruned``). ``sizes``: the kept entries' ``HeldSizes`` when already read
    (else the layer reads them: one host read).
    """
    if cfg.quant_method:
        return quantized_layer(
            kept, seen, cfg.quant_method, cfg.nbits, cfg.residual_length, cfg.q_group_size
        )
    packed = kept.kv_heads is not None or (
        kept.per_head and cfg.get("varlen", True)
    )  # one segment per head
    if channels is not None:
        return (PrunedVarlenLayer if packed else PrunedLayer)(kept, seen, channels, cfg.window_size)
    if kept.keys.shape[-2] == seen and not kept.per_head and not cfg.get("decode_interval"):
        return None
    return (VarlenLayer if packed else CompressedLayer)(kept, seen=seen, sizes=sizes)
