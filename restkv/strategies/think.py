"""ThinK: query-driven pruning of key channels, a strategy for any token eviction (and for fullkv).

Paper: "ThinK: Thinner Key Cache by Query-Driven Pruning" (Xu et al., ICLR 2025),
https://arxiv.org/abs/2407.21018; code: https://github.com/SalesforceAIResearch/ThinK
(``key_pruner_query_driven``, ``recover_cache``).

After token eviction, channel ``c`` of a head's kept keys scores ``mean_t q_{t,c}^2 * mean_j k_{j,c}^2``
(``t`` the last ``window_size`` prompt queries, ``j`` the head's kept entries, both after RoPE) and the
``int(d * pruning_ratio)`` lowest channels are dropped from every kept entry but the ``window_size``
most recent (the original's ``recent_size``, 32 there like its window), which keep all channels, as do
decoded entries. The cache really holds fewer key channels (``restkv.cache.pruned``); attention reads the
kept keys with zeros in the dropped channels (the original's ``recover_cache``), so every logit is
``q . k`` over the kept channels.

GQA: the original expands the cache to the query heads and chooses per query head. With one kept set
per KV head the group shares one choice, and channel ``c`` scores the mean over the group of each query
head's score, ``mean_g(mean_t q_{g,t,c}^2) * mean_j k_{j,c}^2`` (as kvpress's ThinKPress); with
``gqa_agg="none"`` (one kept set per query head) each query head chooses its own, as the original.
Differences: float32 scores; padding queries and entries of a padded batch take no part.
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch

KNOBS = (
    Knob(
        "pruning_ratio",
        None,
        "ThinK: fraction of key channels dropped from the kept entries older than the window "
        "(the original's --pruning_ratio, 0.4 there); none: off",
        rule="in [0, 1)",
        nullable=True,
        of=float,
    ),
)


def pruned_channels(ratio: float, head_dim: int) -> int:
    """Channels dropped per head; a ratio that drops none or all of ``head_dim`` raises a ValueError."""
    pruned = int(head_dim * ratio)
    if not 0 < pruned < head_dim:
        raise ValueError(
            f"pruning_ratio={ratio} drops {pruned} of the {head_dim} key channels of this model "
            f"(int(head_dim * pruning_ratio) must be in [1, {head_dim - 1}])"
        )
    return pruned


def query_energy(queries: "torch.Tensor", key_valid: "torch.Tensor", window: int) -> "torch.Tensor":
    """``mean_t q_{t,c}^2`` over the last ``window`` real queries: [b, Hq, L, d] -> [b, Hq, d] float32."""
    q = queries[:, :, -window:].float()
    real = key_valid[:, -window:].float()[:, None, :, None]  # [b, 1, w, 1]
    return (q.square() * real).sum(2) / real.sum(2).clamp_min(1.0)


def kept_channels(
    keys: "torch.Tensor", valid: "torch.Tensor", energy: "torch.Tensor", ratio: float
) -> "torch.Tensor":
    """The channels each head keeps, in order: LongTensor [b, H, d - int(d * ratio)].

    ``keys`` [b, H, B, d] the kept entries (H the KV heads, or the query heads with one set each),
    ``valid`` [b, B] or [b, H, B], ``energy`` [b, Hq, d] from ``query_energy`` (group mean when H < Hq).
    """
    b, h, _, d = keys.shape
    if energy.shape[1] != h:
        energy = energy.view(b, h, -1, d).mean(2)
    real = (valid if valid.dim() == 3 else valid[:, None].expand(b, h, -1)).float()[..., None]
    key_energy = (keys.float().square() * real).sum(2) / real.sum(2).clamp_min(1.0)
    keep = d - pruned_channels(ratio, d)
    return (energy * key_energy).topk(keep, dim=-1).indices.sort(-1).values
