"""Exact attention over a variable-length, packed KV cache (one segment per sample and head).

A ``VarlenLayer`` holds its entries in one buffer [N + S * room, d]: the N entries kept at the last
eviction, packed segment by segment (no padding), then the entries appended since, one row per segment
and step (every segment gains one entry per token), with room for ``room`` steps. A ``SegmentIndex``,
built once per packed part (and again only when the room grows), holds the buffer row behind every slot
of a padded [S, width + room] view and which slots are held, so a decoding step does no index arithmetic:
it gathers the segments into the padded view (O(held) copying, what a dense cache's append costs) and
attends with one call of the backend's fused kernel (sdpa) and that mask; with a logit softcap the
attention is computed in float32 instead.
"""

from __future__ import annotations

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

    def __init__(self, lengths: Tensor, room: int = 0):
        S, device = lengths.numel(), lengths.device
        self.lengths, self.room = lengths, room
        sizes = torch.stack([lengths.sum(), lengths.max()]).tolist() if S else [0, 0]  # one host read per index
        self.packed, self.width = sizes
        starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))[:-1]
        j = torch.arange(self.width, device=device)
        inside = j < lengths[:, None]
        appended = self.packed + torch.arange(room, device=device) * S + torch.arange(S, device=device)[:, None]
        self.rows = torch.cat([(starts[:, None] + j).masked_fill_(~inside, 0), appended], 1)
        self.visible = torch.cat([inside, inside.new_ones(S, room)], 1)[:, None, None]

    def view(self, keys: Tensor, values: Tensor, steps: int, q: int):
        """Keys and values [S, 1, width + steps, d] gathered from the buffers [>= N + S * steps, d], and
        visible [S, 1, q or 1, width + steps]: ``steps`` appended steps, the last ``q`` the queries' own."""
        S, n = self.lengths.numel(), self.width + steps
        rows = self.rows[:, :n].reshape(-1)
        visible = self.visible[..., :n]
        if q > 1:  # appended slot width + t is seen by query i iff t <= steps - q + i
            slot = torch.arange(n, device=rows.device) - self.width
            visible = visible & (slot <= steps - q + torch.arange(q, device=rows.device)[:, None])
        return (keys.index_select(0, rows).view(S, 1, n, -1), values.index_select(0, rows).view(S, 1, n, -1),
                visible)

    def entries(self, packed: Tensor) -> tuple[Tensor, Tensor]:
        """The packed part [N, ...] per segment, padded: [S, width, ...], and [S, width] bool (held)."""
        rows = self.rows[:, : self.width].reshape(-1)
        padded = packed.index_select(0, rows).view(self.lengths.numel(), self.width, *packed.shape[1:])
        return padded, self.visible[:, 0, 0, : self.width]


def masked_attention(query: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scaling: float,
                     softcap: float | None = None) -> Tensor:
    """query [B, H, q, d] over keys/values [B, 1, L, d] where ``visible`` [B, H or 1, q or 1, L] -> [B, H, q, d].

    The fused kernel (sdpa) in the input dtype; with ``softcap`` the logits are capped, in float32.
    """
    if not softcap:
        return scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scaling, enable_gqa=True)
    logits = (query.float() @ keys.float().transpose(-1, -2)).mul_(scaling).div_(softcap).tanh_().mul_(softcap)
    probs = logits.masked_fill_(~visible, float("-inf")).softmax(-1)
    return (probs @ values.float()).to(query.dtype)


def varlen_attention(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scaling: float) -> Tensor:
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
    visible = visible & (torch.arange(index.width, device=keys.device) <= (lengths - q)[:, None, None, None] + i)
    return masked_attention(query, k, v, visible, scaling)
