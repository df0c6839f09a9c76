"""A transformers cache layer that holds a compressed prefill and grows by decoding.

It stands in for the ``DynamicLayer`` of an evicted layer inside the model's own ``DynamicCache``,
so ``generate()`` works unchanged. ``get_seq_length`` counts every token seen (RoPE positions and
generate's bookkeeping stay those of the full prompt) while the tensors hold only the kept entries.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from .compress import Compressed


class CompressedLayer(DynamicLayer):
    is_croppable = False

    def __init__(self, kept: Compressed, seen: int):
        super().__init__()
        self.device = kept.keys.device
        self.keys, self.values = kept.keys, kept.values
        self.is_initialized = True
        self.seen = seen
        self.positions = kept.positions  # [b, Hkv, B] kept prompt positions
        self.valid = kept.valid  # [b, B]
        self.all_valid = bool(kept.valid.all())

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.seen += key_states.shape[-2]
        return super().update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.keys.shape[-2]
        return stored + query_length, self.seen - stored

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))
        self.valid = self.valid.index_select(0, beam_idx.to(self.valid.device))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed cache layer cannot be cropped")

    def key_valid(self) -> Tensor:
        """[b, n] validity of every stored entry (decoded entries are always valid)."""
        extra = self.keys.shape[-2] - self.valid.shape[1]
        return torch.cat([self.valid, self.valid.new_ones(self.valid.shape[0], extra)], 1)

    def attention_mask(self, query_length: int, implementation: str, dtype: torch.dtype) -> Tensor | None:
        """The mask a backend needs for ``query_length`` new queries over the stored entries.

        Returns None when nothing is masked (one query, no kept padding), a 2D [b, n] padding mask
        for flash-attention, a bool [b, 1, q, n] mask for sdpa, and an additive one for eager.
        """
        if self.all_valid and query_length == 1:
            return None
        valid = self.key_valid()
        if implementation.startswith("flash"):
            return None if self.all_valid else valid.long()
        n = valid.shape[1]
        q = torch.arange(query_length, device=valid.device)[:, None]
        causal = torch.arange(n, device=valid.device)[None, :] <= (n - query_length) + q  # [q, n]
        allowed = causal[None, None] & valid[:, None, None, :]
        if implementation == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
