"""Consecutive chunks of each sample's real tokens, for scorers that work chunk by chunk.

CUR's local normalisation, LagKV's partitions and the non-causal chunked attention use them.

A sample's real tokens are the last ones of the observation (prompts are left padded, and so is the
layout a decoding layer is scored in), so chunk ``j`` of sample ``i`` is its real tokens ``start + j
* size`` to ``start + (j + 1) * size - 1``, counted from its first real token."""

from __future__ import annotations

from ..lazy import torch


def chunk_slots(
    key_valid: "torch.Tensor", size: int, start: int = 0
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Slots of the chunks of ``size`` real tokens from real token ``start`` on.

    ``key_valid`` [b, L] (left padded) -> ``index`` [b, m, size] (the entry each slot holds,
    clamped into [0, L)) and ``held`` [b, m, size] bool (the slot holds a real token at or after
    ``start``), with ``m = ceil((L - start) / size)`` chunks (the longest sample's; a shorter
    sample's last ones are empty).
    """
    b, n = key_valid.shape
    m = max(1, -(-(n - start) // size))
    first = n - key_valid.sum(-1)  # [b] left padding
    slots = torch.arange(m * size, device=key_valid.device)
    index = first[:, None] + start + slots  # [b, m * size]
    held = index < n
    return index.clamp_max(n - 1).view(b, m, size), held.view(b, m, size)


def chunk_sums(x: "torch.Tensor", key_valid: "torch.Tensor", size: int) -> "torch.Tensor":
    """Each entry's chunk total: ``x`` [b, H, L] -> [b, H, L], the sum of ``x`` over the entry's
    chunk of ``size`` real tokens (counted from the sample's first real token; padding entries get
    their own)."""
    b, heads, n = x.shape
    pos = key_valid.long().cumsum(-1) - 1  # [b, L] position from the first real token
    chunk = torch.where(
        key_valid, pos.div(size, rounding_mode="floor"), -(-n // size)
    )  # padding: one more
    chunk = chunk[:, None].expand(b, heads, n)
    totals = x.new_zeros(b, heads, -(-n // size) + 1).scatter_add_(2, chunk, x)
    return totals.gather(2, chunk)


def gather_slots(x: "torch.Tensor", index: "torch.Tensor") -> "torch.Tensor":
    """Slots ``index`` [b, c, s] (``chunk_slots``) of x [b, H, L, d] -> [b, H, c, s, d] float32."""
    b, heads, _, d = x.shape
    flat = index.reshape(b, 1, -1, 1).expand(b, heads, -1, d)
    return x.gather(2, flat).float().view(b, heads, *index.shape[1:], d)
