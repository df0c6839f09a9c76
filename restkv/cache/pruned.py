"""Cache layers whose older kept keys hold only the channels ThinK keeps (``restkv.strategies.think``).

Every kept entry but the ``recent`` newest of each head (the window) stores its key as the head's
``c`` kept channels; the window and decoded entries keep full keys, values stay whole. Attention
reads the keys with zeros in the dropped channels, rebuilt at each step (as the original's
``recover_cache``), so the memory held is ``c / d`` of the older keys.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from .dense import KeptLayer
from .kept import Kept
from .packed import VarlenLayer


def _invalid_first(kept: Kept) -> Kept:
    """With per-head validity, each head's row reordered so its filler comes first: the window then ends every row."""
    if kept.valid.dim() == 2:
        return kept
    order = kept.valid.long().argsort(
        dim=-1, stable=True
    )  # False (filler) first, the kept entries in order
    rows = order[..., None].expand_as(kept.keys)
    return Kept(
        kept.keys.gather(2, rows),
        kept.values.gather(2, rows),
        kept.positions.gather(2, order),
        kept.valid.gather(2, order),
        kept.per_head,
        kept.kv_heads,
    )


def _scatter(pruned: Tensor, channels: Tensor, d: int) -> Tensor:
    """Keys [..., n, c] of ``channels`` [..., c] -> [..., n, d] with zeros in the other channels."""
    index = (
        channels[..., None, :].expand_as(pruned) if pruned.dim() == channels.dim() + 1 else channels
    )
    return pruned.new_zeros(*pruned.shape[:-1], d).scatter_(-1, index, pruned)


class PrunedLayer(KeptLayer, DynamicLayer):
    """Dense kept entries [b, H, B, d]: the first ``B - recent`` keys as ``pruned_keys`` [b, H, B - recent, c]
    (channels ``channels`` [b, H, c]), the rest and the decoded ones as ``keys`` [b, H, *, d]."""

    def __init__(self, kept: Kept, seen: int, channels: Tensor, recent: int):
        DynamicLayer.__init__(self)
        kept = _invalid_first(kept)
        old = kept.keys.shape[-2] - min(recent, kept.keys.shape[-2])
        self.device = kept.keys.device
        self.head_dim = kept.keys.shape[-1]
        self.channels = channels
        self.pruned_keys = kept.keys[:, :, :old].gather(
            -1, channels[:, :, None].expand(-1, -1, old, -1)
        )
        self.keys = kept.keys[:, :, old:].clone()
        self.values = kept.values
        self.is_initialized = True
        self.keep(kept, seen)

    def full_keys(self) -> Tensor:
        """[b, H, stored, d]: the older keys with zeros in the dropped channels, then the full ones."""
        return torch.cat([_scatter(self.pruned_keys, self.channels, self.head_dim), self.keys], -2)

    def update(
        self, key_states: Tensor, value_states: Tensor, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        _, values = super().update(key_states, value_states)
        return self.full_keys(), values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.pruned_keys = self.pruned_keys.index_select(0, beam_idx.to(self.device))
        self.channels = self.channels.index_select(0, beam_idx.to(self.device))


class PrunedVarlenLayer(VarlenLayer):
    """The packed per-head layout (``VarlenLayer``) with each segment's older packed entries as ``pruned_keys``
    [N_old, c] (their channels: ``channels`` [S, c] of segment ``old_segment`` [N_old]); the keys buffer
    holds the other packed keys (``key_rows`` of them, segment by segment), then the appended ones."""

    def __init__(self, kept: Kept, seen: int, channels: Tensor, recent: int):
        super().__init__(kept, seen)
        lengths = self.index.lengths
        N = self.index.packed
        self.channels = channels.reshape(
            -1, channels.shape[-1]
        )  # [S, c], segments in (sample, head) order
        segment = torch.arange(lengths.numel(), device=self.device).repeat_interleave(lengths)
        starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))[:-1]
        within = torch.arange(N, device=self.device) - starts[segment]
        old = within < (lengths - recent).clamp_min(0)[segment]
        self.old_rows = old.nonzero().squeeze(1)
        self.recent_rows = (~old).nonzero().squeeze(1)
        self.old_segment = segment[old]
        self.pruned_keys = self.keys[old].gather(1, self.channels[self.old_segment])
        self.keys = self.keys[~old]
        self.key_rows = self.keys.shape[0]

    def attended_keys(self) -> Tensor:
        """[N + S * steps, d]: the older keys with zeros in the dropped channels, the other packed keys and the
        appended ones, each in its row of the unpruned layout."""
        N = self.index.packed
        appended = self.index.lengths.numel() * self.steps
        out = self.keys.new_empty(N + appended, self.keys.shape[-1])
        out[self.old_rows] = _scatter(
            self.pruned_keys, self.channels[self.old_segment], out.shape[-1]
        )
        out[self.recent_rows] = self.keys[: self.key_rows]
        out[N:] = self.keys[self.key_rows : self.key_rows + appended]
        return out

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError(
            "num_beams > 1 with pruning_ratio and per-head budgets (packed layout) is not supported: "
            "set varlen=False or pruning_ratio=None"
        )

    def stored_entries(self):
        raise NotImplementedError(
            "pruned key channels are not scored again while decoding (decode_interval)"
        )
