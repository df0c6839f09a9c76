"""The index of a packed buffer's segments (``SegmentIndex``) and exact attention over them: the fused kernel
(sdpa) with a mask, or in float32 with a logit softcap (``masked_attention``); each segment's newest entries
attending causally to it (``varlen_attention``)."""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention


class SegmentIndex:
    """Where each segment's entries lie in a buffer [N + S * room, d]; built once per packed part.

    Parameters
    ----------
    lengths : Tensor
        [S] int64 lengths of the packed segments, summing to N.
    room : int
        Steps of appended entries (S rows each) the buffer holds after the packed part.

    Attributes
    ----------
    packed, width : int
        N, and the longest packed segment.
    rows : Tensor
        [S, width + room] the buffer row behind each slot of the padded view (0 on padding).
    visible : Tensor
        [S, 1, 1, width + room] bool, True on the slots a segment holds.
    """

    def __init__(self, lengths: Tensor, room: int = 0, sizes: tuple[int, int] | None = None):
        S = lengths.numel()
        device = lengths.device
        self.lengths = lengths
        self.room = room
        if (
            sizes is None
        ):  # N and the longest segment, unless known (the same lengths with more room)
            sizes = (
                torch.stack([lengths.sum(), lengths.max()]).tolist() if S else [0, 0]
            )  # one host read
        self.packed, self.width = sizes
        starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))[:-1]
        j = torch.arange(self.width, device=device)
        inside = j < lengths[:, None]
        appended = (
            self.packed
            + torch.arange(room, device=device) * S
            + torch.arange(S, device=device)[:, None]
        )
        self.rows = torch.cat([(starts[:, None] + j).masked_fill_(~inside, 0), appended], 1)
        self.visible = torch.cat([inside, inside.new_ones(S, room)], 1)[:, None, None]
        self.remapped = False  # rows of appended steps point to other segments' (``reordered``)

    def bias(self, steps: int, dtype: torch.dtype) -> Tensor:
        """[S, 1, 1, >= width + room] additive mask (as sdpa converts ``visible``): 0 on the slots held once
        ``steps`` steps were appended, -inf on padding and later steps' slots; rows padded to a multiple of
        16 slots (the alignment CUDA's memory-efficient kernel asks of a mask, sliced)."""
        S, n, held = self.lengths.numel(), self.visible.shape[-1], self.width + steps
        bias = self.rows.new_full((S, 1, 1, -(-n // 16) * 16), float("-inf"), dtype=dtype)
        bias[..., :held].masked_fill_(self.visible[..., :held], 0)
        return bias

    def appended_rows(self, first: int, last: int) -> Tensor:
        """[S, last - first] the rows where appended steps ``first:last`` of each segment are
        written."""
        S = self.lengths.numel()
        step = torch.arange(first, last, device=self.lengths.device) * S
        return self.packed + step + torch.arange(S, device=self.lengths.device)[:, None]

    def with_room(self, room: int) -> "SegmentIndex":
        """This index with room for ``room`` appended steps; the slots it has keep their rows."""
        out = copy.copy(self)
        extra = room - self.room
        out.rows = torch.cat([self.rows, self.appended_rows(self.room, room)], 1)
        out.visible = torch.cat(
            [self.visible, self.visible.new_ones(*self.visible.shape[:3], extra)], -1
        )
        out.room = room
        return out

    def reordered(self, segment: Tensor, steps: int) -> "SegmentIndex":
        """The index of segments ``segment`` [S] (each new segment's old one, as many as before):
        each reads its old segment's packed rows and first ``steps`` appended rows, and writes later
        steps to its own rows. No host read, nothing copied: a step's rows stay within that step's
        block of S rows."""
        out = copy.copy(self)
        held = self.width + steps
        out.lengths = self.lengths[segment]
        out.rows = torch.cat([self.rows[segment, :held], self.rows[:, held:]], 1)
        out.visible = self.visible[segment]
        out.remapped = True
        return out

    def restarted(self, steps: int) -> "SegmentIndex":
        """This index with appended steps from ``steps`` on written to each segment's own rows again
        (after a crop of a reordered index)."""
        if not self.remapped:
            return self
        out = copy.copy(self)
        out.rows = torch.cat(
            [self.rows[:, : self.width + steps], self.appended_rows(steps, self.room)], 1
        )
        return out

    def view(self, keys: Tensor, values: Tensor, steps: int, q: int, upto: int | None = None):
        """Keys and values [S, 1, width + upto, d] gathered from the buffers [>= N + S * upto, d] (one kernel
        each, and one to copy the rows unless ``upto`` is the room), and visible [S, 1, q or 1, width + upto]:
        ``steps`` appended steps, the last ``q`` the queries' own. ``upto`` >= steps: the slots gathered; with
        q > 1 none sees those past ``steps``, with q = 1 ``visible`` holds them (``bias`` masks them)."""
        S = self.lengths.numel()
        n = self.width + (steps if upto is None else upto)
        rows = self.rows[:, :n].reshape(-1)
        visible = self.visible[..., :n]
        if q > 1:  # appended slot width + t is seen by query i iff t <= steps - q + i
            slot = torch.arange(n, device=rows.device) - self.width
            visible = visible & (slot <= steps - q + torch.arange(q, device=rows.device)[:, None])
        return (
            keys.index_select(0, rows).view(S, 1, n, -1),
            values.index_select(0, rows).view(S, 1, n, -1),
            visible,
        )

    def entries(self, packed: Tensor) -> tuple[Tensor, Tensor]:
        """The packed part [N, ...] per segment, padded: [S, width, ...], and [S, width] bool (held)."""
        rows = self.rows[:, : self.width].reshape(-1)
        padded = packed.index_select(0, rows).view(
            self.lengths.numel(), self.width, *packed.shape[1:]
        )
        return padded, self.visible[:, 0, 0, : self.width]


def masked_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    visible: Tensor,
    scaling: float,
    softcap: float | None = None,
) -> Tensor:
    """query [B, H, q, d] over keys/values [B, K, L, d] (H a multiple of K) where ``visible`` [B, H or 1, q or 1, L]
    (bool, or an additive mask: 0 or -inf) -> [B, H, q, d].

    The fused kernel (sdpa) in the input dtype; with ``softcap`` the logits are capped, in float32.
    """
    if not softcap:
        return scaled_dot_product_attention(
            query, keys, values, attn_mask=visible, scale=scaling, enable_gqa=True
        )
    groups = query.shape[1] // keys.shape[1]
    if 1 < groups < query.shape[1]:  # several KV heads, each serving a group
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    logits = (
        (query.float() @ keys.float().transpose(-1, -2))
        .mul_(scaling)
        .div_(softcap)
        .tanh_()
        .mul_(softcap)
    )
    if visible.dtype == torch.bool:
        logits = logits.masked_fill_(~visible, float("-inf"))
    else:
        logits = logits.add_(visible)
    probs = logits.softmax(-1)
    return (probs @ values.float()).to(query.dtype)


def heads_as_queries(query: Tensor, visible: Tensor) -> tuple[Tensor, Tensor]:
    """query [B, g, q, d] of g heads sharing one KV head -> [B, 1, g * q, d] (a head's queries one after
    another), and ``visible`` [B, 1, q or 1, L] -> [B, 1, g * q or 1, L]: the same attention without grouped
    heads, which CUDA's fused kernels do not take with a mask (sdpa would fall back to its unfused math)."""
    B, g, q, d = query.shape
    if visible.shape[2] > 1:
        visible = visible[:, :, None].expand(B, 1, g, q, visible.shape[-1]).reshape(B, 1, g * q, -1)
    return query.reshape(B, 1, g * q, d), visible


def varlen_attention(
    query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scaling: float
) -> Tensor:
    """The newest ``q`` entries of each packed segment attend causally to their segment.

    Parameters
    ----------
    query : Tensor
        [S, g, q, d]: the g query heads of each segment, for its last q entries.
    keys, values : Tensor
        [N, d] packed segments.
    lengths : Tensor
        [S] int64 segment lengths (each >= q), summing to N.

    Returns
    -------
    [S, g, q, d] attention outputs in the query dtype; query i sees its segment up to entry
    ``length - q + i``.
    """
    q = query.shape[2]
    index = SegmentIndex(lengths)
    k, v, visible = index.view(keys, values, 0, 1)
    i = torch.arange(q, device=keys.device)[:, None]
    visible = visible & (
        torch.arange(index.width, device=keys.device) <= (lengths - q)[:, None, None, None] + i
    )
    return masked_attention(query, k, v, visible, scaling)
