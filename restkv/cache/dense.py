"""A transformers cache layer that holds a compressed prefill and grows by decoding.

It stands in for the ``DynamicLayer`` of an evicted layer inside the model's own ``DynamicCache``,
so ``generate()`` works unchanged. ``get_seq_length`` counts every token seen (RoPE positions and
generate's bookkeeping stay those of the full prompt) while the tensors hold only the kept entries.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from .kept import HeldSizes, Kept, appended_positions, newest_positions


class KeptLayer:
    """Bookkeeping shared by cache layers that hold the entries kept at prefill.

    ``seen`` counts every token given to the layer (so RoPE positions and generate's bookkeeping stay
    those of the full prompt), ``stored`` the entries actually held.
    """

    is_croppable = (
        True  # the decoded tail (an assistant's rejected candidates), not the kept prompt
    )

    def keep(self, kept: Kept, seen: int, sizes: HeldSizes | None = None) -> None:
        """Hold ``kept`` after ``seen`` tokens; ``sizes`` its ``HeldSizes`` when read already (else
        one host read)."""
        b, hkv, _, d = kept.keys.shape
        self.token_bytes = b * hkv * d * 2 * kept.keys.element_size()  # one token of a full cache
        self.seen = seen
        self.stored = kept.keys.shape[-2]
        self.positions = kept.positions  # [b, Hkv, B] kept prompt positions
        self.valid = (
            kept.valid
        )  # [b, B], or [b, Hkv, B] when heads keep different numbers (masked layout)
        self.sizes = HeldSizes.of(kept.valid, kept.positions) if sizes is None else sizes
        self.all_valid = self.sizes.full
        self.prompt_end = (
            kept.positions.amax((1, 2)) + 1
        )  # [b] real prompt tokens (the last one is always kept)

    def update(
        self, key_states: Tensor, value_states: Tensor, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        self.seen += key_states.shape[-2]
        self.stored += key_states.shape[-2]
        return super().update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored + query_length, self.seen - self.stored

    def held_extent(self, samples: slice = slice(None)) -> tuple[int, bool] | None:
        """``HeldSizes.extent`` of what ``stored_entries`` returns for ``samples``, known without a
        host read (None after a reorder of the samples)."""
        if self.sizes is None:
            return None
        return self.sizes.extent(samples, self.stored - self.valid.shape[-1])

    def seen_per_sample(self) -> tuple | None:
        """``HeldSizes.seen``: each sample's newest position + 1 (the tokens it has seen), known
        without a host read (None after a reorder of the samples)."""
        if self.sizes is None:
            return None
        return self.sizes.seen(self.stored - self.valid.shape[-1])

    def measured_sizes(self) -> Tensor:
        """``HeldSizes.measure`` of the kept entries, on the device (to read with other layers')."""
        count = self.valid.sum(-1)
        return HeldSizes.measure(
            count if count.dim() == 2 else count[:, None],
            self.valid.shape[-1],
            newest_positions(self.positions),
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.sizes = None
        self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))
        self.valid = self.valid.index_select(0, beam_idx.to(self.valid.device))
        self.prompt_end = self.prompt_end.index_select(0, beam_idx.to(self.prompt_end.device))
        if getattr(self, "recent", None) is not None:  # the queries decoding-time eviction observes
            self.recent = self.recent.index_select(0, beam_idx.to(self.recent.device))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last decoded entries: ``-tokens_to_remove`` of them (a positive value: the tokens seen
        to keep, transformers' older convention)."""
        decoded = self.stored - self.positions.shape[-1]
        remove = cropped_tokens(tokens_to_remove, self.seen, decoded, self)
        if remove:
            self.keys = self.keys[..., : self.keys.shape[-2] - remove, :]
            self.values = self.values[..., : self.values.shape[-2] - remove, :]
            self.seen -= remove
            self.stored -= remove

    def key_valid(self) -> Tensor:
        """[b, n] (or [b, Hkv, n]) validity of every stored entry (decoded entries are always valid)."""
        extra = self.stored - self.valid.shape[-1]
        return torch.cat([self.valid, self.valid.new_ones(*self.valid.shape[:-1], extra)], -1)

    def stored_entries(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every stored entry: keys, values [b, H, n, d], validity and positions [b, H, n] (-1 where invalid)."""
        keys = self.keys
        b, heads, n, _ = keys.shape
        valid = self.key_valid()
        valid = valid if valid.dim() == 3 else valid[:, None].expand(b, heads, n)
        return keys, self.values, valid, appended_positions(self.positions, n)

    def attention_mask(
        self,
        query_length: int,
        implementation: str,
        dtype: torch.dtype,
        groups: int = 1,
        window: int | None = None,
    ) -> Tensor | None:
        """The mask a backend needs for ``query_length`` new queries over the stored entries.

        Returns None when nothing is masked (one query, no kept padding), a 2D [b, n] padding mask
        for flash-attention, a bool [b, 1 or Hq, q, n] mask for sdpa, and an additive one for eager.
        Flash-attention takes one padding mask per sample: where heads hold different entries (per-head
        budgets without ``varlen``) or a sliding window bounds the kept entries, it gets the bool mask,
        and the caller attends with sdpa (``restkv.cache.segments.masked_attention``).
        ``window``: the layer's sliding window W; a query at position t then sees only entries at
        positions > t - W (as the model's sliding-window mask), once the tokens seen exceed W.
        """
        sliding = window is not None and self.seen > window
        if self.all_valid and query_length == 1 and not sliding:
            return None
        valid = self.key_valid()
        per_head = valid.dim() == 3
        if implementation.startswith("flash") and not (per_head or sliding):
            return None if self.all_valid else valid.long()
        n = valid.shape[-1]
        q = torch.arange(query_length, device=valid.device)[:, None]
        causal = torch.arange(n, device=valid.device)[None, :] <= (n - query_length) + q  # [q, n]
        heads = valid[:, :, None, :] if per_head else valid[:, None, None, :]  # [b, Hkv or 1, 1, n]
        if sliding:
            heads = heads & self.within_window(query_length, window)  # [b, Hkv, q, n]
        allowed = causal[None, None] & (
            heads.repeat_interleave(groups, 1) if heads.shape[1] > 1 else heads
        )
        if implementation != "eager":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    def within_window(self, query_length: int, window: int) -> Tensor:
        """[b, Hkv, q, n] bool: which stored entries each of the ``query_length`` newest queries sees under a
        sliding window (position distance < ``window``); kept prompt entries, then the decoded ones."""
        decoded = (
            self.stored - self.positions.shape[-1]
        )  # entries appended since prefill (the queries' among them)
        end = self.prompt_end[:, None]  # [b, 1]
        step = torch.arange(decoded, device=end.device)
        entry = torch.cat(
            [self.positions, (end + step).unsqueeze(1).expand(-1, self.positions.shape[1], -1)], -1
        )
        query = (
            end + (decoded - query_length) + torch.arange(query_length, device=end.device)
        )  # [b, q]
        return query[:, None, :, None] - entry[:, :, None, :] < window


def cropped_tokens(tokens_to_remove: int, seen: int, decoded: int, layer) -> int:
    """How many entries a ``crop(tokens_to_remove)`` removes from a layer that has seen ``seen`` tokens,
    ``decoded`` of them since its last eviction; raises when that reaches into what the eviction kept."""
    remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, seen - tokens_to_remove)
    if remove > decoded or (remove and getattr(layer, "policy", None) is not None):
        raise ValueError(
            f"crop: cannot remove {remove} entries; only the {decoded} decoded since "
            "the eviction can be (and none with decode_interval)"
        )
    return remove


class CompressedLayer(KeptLayer, DynamicLayer):
    """The kept entries as dense [b, Hkv, B, d] tensors; decoding appends to them.

    With ``room`` > 0 the tensors are views of buffers with space for that many decoded tokens, so
    decoding writes in place instead of copying the cache at every step (beyond the room it copies).
    """

    def __init__(self, kept: Kept, seen: int, room: int = 0, sizes: HeldSizes | None = None):
        DynamicLayer.__init__(self)
        self.device = kept.keys.device
        self.keys = kept.keys
        self.values = kept.values
        self._buffers = None
        if room:
            b, hkv, n, d = kept.keys.shape
            self._buffers = [x.new_empty(b, hkv, n + room, d) for x in (kept.keys, kept.values)]
            self._buffers[0][:, :, :n] = kept.keys
            self._buffers[1][:, :, :n] = kept.values
            self.keys, self.values = (buf[:, :, :n] for buf in self._buffers)
        self.is_initialized = True
        self.keep(kept, seen, sizes)

    def update(
        self, key_states: Tensor, value_states: Tensor, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        n = self.stored
        q = key_states.shape[-2]
        if (
            self._buffers is None
            or n + q > self._buffers[0].shape[-2]
            or self.keys.data_ptr() != self._buffers[0].data_ptr()
        ):  # out of room, or keys replaced
            self._buffers = None
            return super().update(key_states, value_states)
        for buf, new in zip(self._buffers, (key_states, value_states)):
            buf[:, :, n : n + q] = new
        self.keys, self.values = (buf[:, :, : n + q] for buf in self._buffers)
        self.seen, self.stored = self.seen + q, n + q
        return self.keys, self.values
