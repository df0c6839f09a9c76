"""``Kept``: the entries a layer keeps, the contract between the selection and the cache layers."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Kept:
    """The entries a layer keeps."""

    keys: Tensor  # [b, H, B, d]: H = Hkv (or Hq with gqa_agg="none"); B the longest head's when heads differ
    values: Tensor  # [b, H, B, d]
    positions: Tensor  # [b, H, B] position from the sample's first real token, -1 on padding
    valid: Tensor  # [b, B] bool, False on kept padding (same for every head); [b, H, B] with per-head budgets
    per_head: bool = False  # heads keep different numbers of entries
    kv_heads: int | None = (
        None  # the model's KV heads when H is the query heads (one kept set per query head)
    )
    index: Tensor | None = (
        None  # [b, H, B] which of the observed entries each slot holds (None: not recorded)
    )

    def narrowed(self, width: int) -> "Kept":
        """The first ``width`` slots of every head (slots past every head's last kept entry
        dropped)."""
        index = None if self.index is None else self.index[..., :width]
        return replace(
            self,
            keys=self.keys[..., :width, :],
            values=self.values[..., :width, :],
            positions=self.positions[..., :width],
            valid=self.valid[..., :width],
            index=index,
        )


@dataclass(frozen=True)
class HeldSizes:
    """What a cache layer needs to know on the host about the entries it keeps, read in one go.

    total: entries kept in all; full: every slot of the [b, (H,) B] layout is kept; longest[i],
    differ[i]: the most entries a head of sample i keeps, and whether its heads keep different
    numbers; ends[i]: sample i's newest kept position + 1 (the tokens it had seen, when its newest
    entry is kept).
    """

    total: int
    full: bool
    longest: tuple
    differ: tuple
    ends: tuple

    @staticmethod
    def measure(count: Tensor, width, newest: Tensor) -> Tensor:
        """The sizes as one long tensor on ``count``'s device, to read with others':
        ``count`` [b, H] entries per head, ``width`` the slots per head (an int or a device scalar),
        ``newest`` [b] each sample's newest kept position (``newest_positions``)."""
        b = count.shape[0]
        if count.numel() == 0:
            return count.new_zeros(2 + 3 * b)
        longest = count.amax(1)
        differ = (count.amin(1) != longest).long()
        ends = newest.to(count) + 1
        return torch.cat(
            [torch.stack([count.sum(), (count == width).all().long()]), longest, differ, ends]
        )

    @classmethod
    def read(cls, values: list) -> "HeldSizes":
        """The sizes from ``measure``'s values (a list of ints)."""
        b = (len(values) - 2) // 3
        return cls(
            values[0],
            bool(values[1]),
            tuple(values[2 : 2 + b]),
            tuple(map(bool, values[2 + b : 2 + 2 * b])),
            tuple(values[2 + 2 * b :]),
        )

    @classmethod
    def of(cls, valid: Tensor, positions: Tensor) -> "HeldSizes":
        """The sizes of entries with validity ``valid`` [b, B] or [b, H, B] and positions
        ``positions`` [b, H, B] (one host read)."""
        count = valid.sum(-1)
        count = count if count.dim() == 2 else count[:, None]
        newest = newest_positions(positions)
        return cls.read(cls.measure(count, valid.shape[-1], newest).tolist())

    def extent(self, samples: slice, decoded: int) -> tuple[int, bool]:
        """``(most entries a head holds, every sample's heads hold as many)`` over ``samples`` once
        ``decoded`` entries were appended to every head."""
        return max(self.longest[samples]) + decoded, not any(self.differ[samples])

    def seen(self, decoded: int) -> tuple:
        """Each sample's newest position + 1 once ``decoded`` entries were appended after its kept
        ones (one position after another, as ``appended_positions`` numbers them)."""
        return tuple(end + decoded for end in self.ends)


def newest_positions(positions: Tensor) -> Tensor:
    """[b] each sample's newest position in ``positions`` [b, H, n] (-1 where it holds none)."""
    if positions.shape[-1] == 0:
        return positions.new_full(positions.shape[:1], -1)
    return positions.amax((1, 2))


def stack_samples(parts: list[Kept]) -> Kept:
    """The kept entries of several samples (one ``Kept`` each, of batch 1) as one batch, per head.

    Shorter ones are padded at the end and marked invalid, so the result has per-head validity.
    When some keep one set per query head (``kv_heads``), a sample that kept one per KV head (all
    it held) repeats it for each query head of its group.
    """
    width = max(p.keys.shape[-2] for p in parts)
    heads = max(p.keys.shape[1] for p in parts)
    kv_heads = next((p.kv_heads for p in parts if p.kv_heads is not None), None)

    def spread(t):  # [1, h, ...] -> [1, heads, ...]
        return t.repeat_interleave(heads // t.shape[1], 1)

    def pad(t, fill):
        return F.pad(
            t,
            (0, 0, 0, width - t.shape[-2]) if t.dim() == 4 else (0, width - t.shape[-1]),
            value=fill,
        )

    def per_head(p):
        return spread(p.valid) if p.valid.dim() == 3 else p.valid[:, None].expand(-1, heads, -1)

    return Kept(
        torch.cat([pad(spread(p.keys), 0) for p in parts]),
        torch.cat([pad(spread(p.values), 0) for p in parts]),
        torch.cat([pad(spread(p.positions), -1) for p in parts]),
        torch.cat([pad(per_head(p), False) for p in parts]),
        per_head=True,
        kv_heads=kv_heads,
    )


def appended_positions(kept: Tensor, n: int) -> Tensor:
    """Positions [b, H, n] of n stored entries: the ``kept`` ones [b, H, K] (-1 on padding), then the entries
    appended since, one position after another from the sample's newest kept entry."""
    b, heads, k = kept.shape
    after = kept.amax((1, 2), keepdim=True) + 1 + torch.arange(n - k, device=kept.device)
    return torch.cat([kept, after.expand(b, heads, n - k)], -1)
