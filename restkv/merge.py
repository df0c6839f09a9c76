"""Pivot merging: each evicted entry is averaged into the kept entry whose key is most similar.

Keys and values move together (one target per evicted entry), in the manner of LOOK-M / KVMerger:
``new_r = (r + sum_e (x_e + r) / 2) / (1 + n_r)`` for both keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def pivot_merge(keys: Tensor, values: Tensor, kept_idx: Tensor, evicted: Tensor) -> tuple[Tensor, Tensor]:
    """Merge evicted entries into the kept ones.

    Parameters
    ----------
    keys, values : Tensor
        [b, Hkv, L, d], the full prefill cache.
    kept_idx : Tensor
        [b, Hkv, B] indices of the kept entries.
    evicted : Tensor
        [b, Hkv, L] bool, True on the (real) entries that are dropped.

    Returns
    -------
    The kept keys and values [b, Hkv, B, d] after merging, in the input dtype.
    """
    d = keys.shape[-1]
    gather = kept_idx[..., None].expand(-1, -1, -1, d)
    kept_k = keys.gather(2, gather).float()
    kept_v = values.gather(2, gather).float()
    sim = F.normalize(keys.float(), dim=-1, eps=1e-6) @ F.normalize(kept_k, dim=-1, eps=1e-6).transpose(-1, -2)
    target = sim.argmax(-1)  # [b, Hkv, L]
    weight = evicted.float()
    count = torch.zeros_like(kept_k[..., 0]).scatter_add_(2, target, weight)  # n_r

    def merge(full: Tensor, kept: Tensor) -> Tensor:
        incoming = torch.zeros_like(kept).scatter_add_(2, target[..., None].expand(-1, -1, -1, d), full.float() * weight[..., None])
        return (kept * (1 + count[..., None] / 2) + incoming / 2) / (1 + count[..., None])

    return merge(keys, kept_k).to(keys.dtype), merge(values, kept_v).to(values.dtype)
