"""Hindsight selections of one layer's kept set: the future queries' attention, kept sets as masks and as cache
layers. The layer-output error they are judged by and the swap search are restkv's (``restkv.scoring.output_error``,
``restkv.strategies.refine``), run here on the future queries instead of the window's.

Shapes: ``b`` batch, ``Hq`` / ``Hkv`` query / KV heads (``g = Hq // Hkv``, the query heads of a KV head
contiguous), ``r`` observed queries, ``N`` keys they see, ``P`` the evictable prefix (the first ``P``
keys; every key from ``P`` on is always kept), ``d`` head dim, ``D`` hidden size. A kept set is a bool
mask ``keep`` [b, H, P] with H = Hkv (one set per KV head) or Hq.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from restkv.cache import CompressedLayer
from restkv.scoring.output_error import layer_output_error, layer_terms, output_change  # noqa: F401 (this module's API)
from restkv.strategies.refine import swap_search, top_set  # noqa: F401
from restkv.eviction.select import Kept, reduce_groups


def future_attention(attention: Tensor, hkv: int, prefix: int) -> Tensor:
    """[b, Hq, r, N] -> [b, Hkv, P]: each prefix key's attention, mean over the queries, then over the GQA group."""
    return reduce_groups(attention[..., :prefix].float().mean(-2), hkv, "mean")


def positions_mask(positions: Tensor, prefix: int) -> Tensor:
    """Kept positions [b, H, K] (-1: none, those >= P ignored) -> mask [b, H, P]."""
    idx = positions.masked_fill((positions < 0) | (positions >= prefix), prefix)
    out = torch.zeros(*positions.shape[:2], prefix + 1, dtype=torch.bool, device=positions.device)
    return out.scatter_(-1, idx, True)[..., :prefix]


def cache_layer(keep: Tensor, keys: Tensor, values: Tensor) -> CompressedLayer:
    """The cache layer that holds a kept set: keep [b, Hkv, P] (the same count in every head), the prompt's
    keys / values [b, Hkv, L, d] (its last L - P entries always kept)."""
    b, hkv, n, d = keys.shape
    full = F.pad(keep, (0, n - keep.shape[-1]), value=True)
    idx = torch.arange(n, device=keys.device).expand(b, hkv, n)[full].view(b, hkv, -1)  # position order

    def gather(x):
        return x.gather(2, idx[..., None].expand(-1, -1, -1, d))

    valid = torch.ones(b, idx.shape[-1], dtype=torch.bool, device=keys.device)
    return CompressedLayer(Kept(gather(keys), gather(values), idx, valid), seen=n)
