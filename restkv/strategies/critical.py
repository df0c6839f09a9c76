"""CriticalKV's two-stage selection, a strategy for any scorer (``critical=True``).

Paper: "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective" (Feng et al.,
2025), https://arxiv.org/abs/2502.03805; code: kvpress ``CriticalKVPress`` / ``CriticalAdaKVPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/criticalkv_press.py``), the same algorithm as the
paper's branch (https://github.com/FFY0/AdaKV-in-NVIDIA-kvpress, ``criticalkv``).

A head keeping K prefix entries (its budget, uniform or per head) first keeps its top ``n1`` by the base
score, then fills the rest by ``(s + critical_epsilon) * ||W_O^h v_n||_1`` (the L1 norm over the hidden
dimension of the value after the head's slice of o_proj; the mean over a GQA group for a KV head, as the
reference). ``n1 = floor(first_stage_ratio * (K + w)) - w`` (at least 0): in the reference the window
carries the top score and so takes the first ``w`` places of the first stage, whose size is
``first_stage_ratio`` times the whole budget; per-head budgets (``head_budget``) give per-head first
stages, as CriticalAdaKV. Applied after the GQA reduction and the per-head budgets (computed from the
base scores, as the reference), before the top-k; merging reads the base scores.

The L1 norm needs the projection itself (hidden x d multiply-adds per entry and head, blocked so no
[b, H, L, hidden] tensor is formed); ``value_norm="l2"`` uses the exact L2 norm ``||R_h v||`` from the
d x d factor instead, hidden / d times cheaper (kvpress issue #45 reports L1 and L2 about equal).
The re-weighting assumes non-negative scores (attention-like), as the reference.
"""

from __future__ import annotations

from ..knobs import VALUE_NORM, Knob
from ..lazy import torch

_ON = {"critical": (True,)}

KNOBS = (
    Knob(
        "critical",
        False,
        "CriticalKV's two stages over the method's scores: the top first_stage_ratio of the "
        "budget by the score, the rest by (score + critical_epsilon) * ||W_O v||",
        stage="select",
    ),
    Knob(
        "first_stage_ratio",
        0.5,
        "CriticalKV: share of the budget (window included) chosen by the score alone",
        rule="in (0, 1)",
        when=_ON,
        stage="select",
    ),
    Knob(
        "critical_epsilon",
        1e-4,
        "CriticalKV: added to the scores before they are weighted by the value norms",
        rule=">= 0",
        when=_ON,
        stage="select",
    ),
    VALUE_NORM.but(when=_ON),
)


def first_stage_sizes(keep, window: int, ratio: float):
    """Entries of the first stage per head: ``floor(ratio * (keep + window)) - window``, in [0, keep]."""
    if isinstance(keep, int):
        return min(keep, max(0, int(ratio * (keep + window)) - window))
    return (((keep + window).double() * ratio).floor().long() - window).clamp(min=0).minimum(keep)


def two_stage(
    scores: "torch.Tensor", keep, window: int, norms: "torch.Tensor", ratio: float, epsilon: float
) -> "torch.Tensor":
    """The ranking key [b, H, P] of the two stages: ``inf`` on each head's first stage, else
    ``(scores + epsilon) * norms`` (``-inf`` where the score is: padding).

    scores [b, H, P] (padding ``-inf``), keep an int or [b, H] entries kept per head, norms [b, H, P].
    """
    n1 = first_stage_sizes(keep, window, ratio)
    if isinstance(n1, int):
        first = torch.zeros_like(scores, dtype=torch.bool).scatter_(
            -1, scores.topk(n1, dim=-1).indices, True
        )
    else:
        rank = scores.argsort(-1, descending=True).argsort(-1)
        first = rank < n1[..., None]
    finite = torch.isfinite(scores)
    second = torch.where(finite, (scores + epsilon) * norms, scores)
    return second.masked_fill(first & finite, float("inf"))


def value_norms(obs, heads: int, norm: str) -> "torch.Tensor":
    """||W_O^h v_n|| [b, heads, P]: per query head (``heads`` = Hq), or the mean over each GQA group."""
    n = obs.projected_value_norms(norm)
    if heads == n.shape[1]:
        return n
    return n.view(n.shape[0], heads, -1, n.shape[-1]).mean(2)


def applies(cfg) -> bool:
    return bool(cfg.get("critical"))


def rank(obs, cfg, scores: "torch.Tensor", key: "torch.Tensor", keep) -> "torch.Tensor":
    """The selection hook: the two stages' key [b, H, P] from the scores [b, H, P]; ``keep`` entries per head."""
    norms = value_norms(obs, scores.shape[1], cfg.value_norm)
    return two_stage(scores, keep, obs.window, norms, cfg.first_stage_ratio, cfg.critical_epsilon)
