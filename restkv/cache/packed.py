"""Exact attention over a variable-length, packed KV cache (one segment per sample and head).

A ``VarlenLayer`` holds its entries in one buffer [N + S * room, d]: the N entries kept at the last
eviction, packed segment by segment (no padding), then the entries appended since, one row per segment
and step (every segment gains one entry per token), with room for ``room`` steps. A ``SegmentIndex`` (``segments``),
built once per packed part (and again only when the room grows), holds the buffer row behind every slot
of a padded [S, width + room] view and which slots are held, so a decoding step does no index arithmetic:
it writes its entries and opens their slots in the layer's additive mask (in place), gathers the segments
into the padded view (O(held) copying, what a dense cache's append costs) and attends with one call of the
backend's fused kernel (sdpa) and that mask; with a logit softcap the attention is computed in float32
instead. On CUDA the view spans the whole room, so its shapes change only when the room grows (sdpa may
build a plan per shape), and a segment's query heads attend as queries of one head (``VarlenLayer.attend``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from .dense import cropped_tokens
from .kept import HeldSizes, Kept, appended_positions, newest_positions
from .segments import (  # noqa: F401  (read from here too)
    SegmentIndex,
    heads_as_queries,
    masked_attention,
    varlen_attention,
)


class VarlenLayer(DynamicLayer):
    """Per-head budgets: the kept entries of every (sample, head) packed back to back.

    ``keys`` / ``values`` are buffers [N + S * room, d]: the N kept entries (N the sum of the per-head
    lengths, padding dropped, so memory follows what each head keeps, not the longest head), then the
    entries appended since, one row per segment and step, with room for more (none after prefill; when it
    runs out, ``growth`` more steps: a 32nd of the packed segments' mean length or a quarter of the steps
    appended, whichever is larger, so the buffers are copied O(log steps) times; or what ``reserve`` asked
    for). The heads are the KV heads, or the query heads when each keeps its own set (``gqa_agg="none"``:
    new entries are repeated for the query heads of their KV head). See ``restkv.cache.packed``. ``key_rows``:
    the rows of the keys buffer before its appended part (N here; fewer when older keys live elsewhere,
    ``restkv.cache.pruned``).
    """

    is_croppable = True  # the appended steps (assisted decoding's rejected candidates)
    cuda_layout = None  # lay out and attend as on CUDA (``attend``): None on CUDA only (tests force it)

    def __init__(self, kept: Kept, seen: int, sizes: HeldSizes | None = None):
        super().__init__()
        b, heads, _, d = kept.keys.shape
        valid = kept.valid if kept.valid.dim() == 3 else kept.valid[:, None].expand(b, heads, -1)
        self.device = kept.keys.device
        self.shape = (b, heads, d)
        if sizes is None:
            sizes = HeldSizes.of(valid, kept.positions)  # one host read
        self.sizes = sizes
        held = _held_slots(valid, self.sizes.total)
        self.keys = kept.keys.flatten(0, 2).index_select(0, held)  # [N, d], segment order
        self.values = kept.values.flatten(0, 2).index_select(0, held)
        self.packed_positions = kept.positions.flatten().index_select(0, held)  # [N]
        longest = max(self.sizes.longest, default=0)
        self.index = SegmentIndex(valid.sum(-1).flatten(), 0, (self.sizes.total, longest))
        self.key_rows = self.index.packed
        self.steps = self.capacity = 0  # appended steps, and how many this layer's buffers hold
        self.token_bytes = (
            b * (kept.kv_heads or heads) * d * 2 * kept.keys.element_size()
        )  # one full-cache token
        self.kv_heads = kept.kv_heads
        self.is_initialized = True
        self.seen = seen
        self.positions = kept.positions
        self.bias = None  # (index, steps, dtype, ``SegmentIndex.bias``): the mask ``attend`` reads

    @property
    def lengths(self) -> Tensor:
        """[b * heads] entries held per segment."""
        return self.index.lengths + self.steps

    def __copy__(self) -> "VarlenLayer":
        """A copy that shares what is held so far and never writes the buffers again (its first append
        moves it to buffers of its own), so the original stays as it is."""
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.capacity = self.steps
        out.bias = None
        return out

    def reserve(self, steps: int) -> None:
        """Make room for ``steps`` more appended steps (one copy of what is held, when it grows; the new
        rows zero, finite where the mask hides them). On CUDA width + room is rounded up to a multiple of a
        power of two <= width / 8."""
        if self.steps + steps <= self.capacity:
            return
        room = max(self.steps + steps, self.index.room)
        if self.on_cuda:  # attended shapes shared by layers and rooms: width + room rounded up
            unit = 1 << max(0, self.index.width.bit_length() - 4)  # a power of two <= width / 8
            room = -(-(self.index.width + room) // unit) * unit - self.index.width
        segments = self.index.lengths.numel()
        grown = []
        for x, head in ((self.keys, self.key_rows), (self.values, self.index.packed)):
            grown.append(x.new_zeros(head + segments * room, x.shape[-1]))  # finite where masked
            grown[-1][: head + segments * self.steps] = x[: head + segments * self.steps]
        self.keys = grown[0]
        self.values = grown[1]
        self.capacity = room
        if room > self.index.room:
            self.index = self.index.with_room(room)

    def growth(self, q: int) -> int:
        """Steps of room added when ``q`` more do not fit."""
        return max(
            q, self.index.packed // max(1, 32 * self.index.lengths.numel()), (self.steps + q) // 4
        )

    def update(
        self, key_states: Tensor, value_states: Tensor, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        b, hkv, q, d = key_states.shape
        segments = self.index.lengths.numel()
        if self.steps + q > self.capacity:
            self.reserve(self.growth(q))
        for buf, new, head in (
            (self.keys, key_states, self.key_rows),
            (self.values, value_states, self.index.packed),
        ):
            start = head + segments * self.steps  # rows step by step, then segment
            new = (
                new[:, :, None].expand(b, hkv, segments // (b * hkv), q, d).reshape(segments, q, d)
            )
            buf[start : start + segments * q] = new.transpose(0, 1).reshape(segments * q, d)
        if self.bias is not None and self.bias[:2] == (self.index, self.steps):  # open their slots
            start = self.index.width + self.steps
            self.bias[3][..., start : start + q] = 0
            self.bias = (self.index, self.steps + q, *self.bias[2:])
        self.steps += q
        self.seen += q
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen

    def held_extent(self, samples: slice = slice(None)) -> tuple[int, bool] | None:
        """``HeldSizes.extent`` of what ``stored_entries`` returns for ``samples``, known without a
        host read (None after a reorder of the samples)."""
        return None if self.sizes is None else self.sizes.extent(samples, self.steps)

    def seen_per_sample(self) -> tuple | None:
        """``HeldSizes.seen``: each sample's newest position + 1 (the tokens it has seen), known
        without a host read (None after a reorder of the samples)."""
        return None if self.sizes is None else self.sizes.seen(self.steps)

    def measured_sizes(self) -> Tensor:
        """``HeldSizes.measure`` of the kept entries, on the device (to read with other layers')."""
        b, heads, _ = self.shape
        return HeldSizes.measure(
            self.index.lengths.view(b, heads), self.index.width, newest_positions(self.positions)
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep samples ``beam_idx`` [b'] (beam search's reordering; any selection of samples). As
        many samples as before (beam search): each new segment reads its source segment's rows, no
        host read and nothing copied (``SegmentIndex.reordered``); otherwise the rows are gathered
        into new buffers (one host read, the new index)."""
        b, heads, d = self.shape
        beam_idx = beam_idx.to(self.device)
        head = torch.arange(heads, device=self.device)
        segment = (beam_idx[:, None] * heads + head).flatten()  # each new segment's old one
        if segment.numel() == self.index.lengths.numel():
            self.index = self.index.reordered(segment, self.steps)
        else:
            self._gather_segments(segment)
        self.sizes = None
        self.positions = self.positions.index_select(0, beam_idx)
        self.shape = (beam_idx.numel(), heads, d)
        if getattr(self, "recent", None) is not None:
            self.recent = self.recent.index_select(0, beam_idx)

    def _gather_segments(self, segment: Tensor) -> None:
        """New buffers holding segments ``segment`` [S'] of the old ones, packed, then their
        appended steps."""
        old = self.index
        steps = self.steps
        d = self.shape[-1]
        index = SegmentIndex(old.lengths[segment], old.room)
        held = index.visible[:, 0, 0, : index.width]
        packed = old.rows[segment, : index.width].masked_select(held)
        appended = old.rows[segment, old.width : old.width + steps].transpose(0, 1)
        rows = torch.cat([packed, appended.flatten()])
        for name in ("keys", "values"):
            buf = getattr(self, name)
            grown = buf.new_zeros(index.packed + segment.numel() * max(self.capacity, steps), d)
            grown[: rows.numel()] = buf.index_select(0, rows)
            setattr(self, name, grown)
        self.packed_positions = self.packed_positions.index_select(0, packed)
        self.index = index
        self.key_rows = index.packed
        self.capacity = max(self.capacity, steps)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last appended steps: ``-tokens_to_remove`` of them (a positive value: the
        tokens seen to keep)."""
        remove = cropped_tokens(tokens_to_remove, self.seen, self.steps, self)
        self.steps -= remove
        self.seen -= remove
        self.index = self.index.restarted(self.steps)

    def attend(self, query: Tensor, scaling: float, softcap: float | None = None) -> Tensor:
        """Attention of the newest q entries' queries [b, Hq, q, d] -> [b, q, Hq, d] (the backends' layout).

        A decoding step (q = 1) launches the two gathers of ``SegmentIndex.view`` and one fused kernel, its
        mask the layer's ``bias`` (``mask``; ``update`` opens a step's slots in place). On CUDA (``on_cuda``)
        the view spans the whole room, width + room rounded up (``reserve``), so its shapes change
        only when the room grows and are shared by layers (sdpa may build a plan per shape: cuDNN's graphs),
        and a segment's g query heads attend as g * q queries of one head (``heads_as_queries``): CUDA's fused
        kernels take no mask with grouped heads."""
        b, hq, q, d = query.shape
        keys, index = self.attended_keys(), self.index
        cuda = self.on_cuda
        rows = index.packed + index.lengths.numel() * index.room  # the whole room, if both hold it
        upto = index.room if cuda and min(len(keys), len(self.values)) >= rows else self.steps
        keys, values, visible = index.view(keys, self.values, self.steps, q, upto)
        if q == 1:
            visible = self.mask(query.dtype)[..., : keys.shape[2]]
        query = query.reshape(index.lengths.numel(), -1, q, d)
        if cuda:
            query, visible = heads_as_queries(query, visible)
        out = masked_attention(query, keys, values, visible, scaling, softcap)
        return out.reshape(b, hq, q, d).transpose(1, 2)

    @property
    def on_cuda(self) -> bool:
        """Whether this layer lays out and attends as on CUDA (``cuda_layout``)."""
        return self.device.type == "cuda" if self.cuda_layout is None else self.cuda_layout

    def mask(self, dtype: torch.dtype) -> Tensor:
        """The index's ``bias`` after the appended steps, kept while the index and dtype stay (``update``
        opens each step's slots in it); made anew after a room growth, a reorder or a crop."""
        if self.bias is None or self.bias[:3] != (self.index, self.steps, dtype):
            self.bias = (self.index, self.steps, dtype, self.index.bias(self.steps, dtype))
        return self.bias[3]

    def attended_keys(self) -> Tensor:
        """The keys buffer attention reads [>= N + S * steps, d]."""
        return self.keys

    def stored_entries(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every stored entry, each head padded after its packed part: keys, values [b, H, n, d], validity and
        positions [b, H, n] (-1 where invalid)."""
        b, heads, d = self.shape
        T = self.steps
        keys, values, visible = self.index.view(self.keys, self.values, T, 1)
        keys, values = (x.view(b, heads, -1, d) for x in (keys, values))
        kept, inside = self.index.entries(self.packed_positions)
        kept = kept.masked_fill(~inside, -1).view(b, heads, -1)
        valid = visible.reshape(b, heads, -1)
        return keys, values, valid, appended_positions(kept, kept.shape[-1] + T)


def _held_slots(valid: Tensor, total: int) -> Tensor:
    """[total] the kept slots of ``valid`` [b, H, B] in flattened order, with no host sync
    (``total`` of them, known)."""
    return (~valid).flatten().to(torch.uint8).argsort(stable=True)[:total]
