"""DefensiveKV: a worst-case (defensive) aggregation of the window's attention, then CriticalKV's two stages.

Paper: "Taming the Fragility of KV Cache Eviction in LLM Inference" (Feng et al., ICLR 2026),
https://arxiv.org/abs/2510.13334; code: https://github.com/FFY0/DefensiveKV
(``kvpress/presses/efficient_defensivekv_press.py``).

With ``A`` the window queries' attention over the prefix [b, Hq, w, P]:

1. each query row is average-pooled (``kernel_size``) and rescaled to its own sum before pooling;
2. ``m_n`` = the largest of those rows over the window queries and the GQA group, floored at its mean over
   the prefix: ``s_n = max(m_n, mean m)``;
3. ``s_n`` times ``N_n / sum_heads N_n`` with ``N_n = mean_group ||W_O^h v_n||_1`` (normalised over the
   layer's KV heads at each position);
4. first stage: each KV head's most attended entries (by the unpooled attention, mean over the group and the
   window) up to ``first_stage_mass - bias`` of its attention mass get the layer's largest score, ``bias``
   being the mean attention on the ``w`` prefix entries just before the window (the reference's quantity;
   at most ``B - w`` entries), ranked just above the rest.

Registered with ``head_budget="adakv", floor=0.0``: one top-k over the layer's heads, without a safeguard,
as the reference. ``score`` is per layer and needs nothing of the others, so a cross-layer allocation can
rank every layer's scores as they are (Layer-DefensiveKV compares them unnormalised).
Differences: the first stage is capped at ``B - w`` (the reference: ``int((L - w) B / L) - w``, slightly
fewer) and its entries rank strictly first (the reference gives them the layer's largest score, so they
tie with the entry that has it, and a full first stage leaves the choice to the top-k's tie order);
``bias``, the means and the layer's largest score are per sample (the reference: over the batch), and a
padded sample is pooled over its real entries only (each sample scores as it would alone); the attention
is float32 throughout (the reference casts it to the model dtype); ``value_norm="l2"`` is an exact,
cheaper alternative to the reference's L1 norm (see ``restkv.strategies.critical``).
"""

from __future__ import annotations

from ..knobs import KERNEL_SIZE, VALUE_NORM, Knob
from ..lazy import torch
from ..scoring.observe import group_view
from ..scoring.smoothing import pool1d

_TINY = 1.1754943508222875e-38  # the smallest normal float32

KNOBS = (
    KERNEL_SIZE.but(
        default=5, when=(), help="odd width of the average pooling of each window query's row"
    ),
    Knob(
        "first_stage_mass",
        0.9,
        "attention mass (less the window's bias) whose entries are kept first",
        rule="in (0, 1]",
    ),
    VALUE_NORM.but(stage="score"),
)


def uses_budget(cfg) -> bool:
    """The first stage is capped at the layer's prefix budget."""
    return True


def check(values: dict) -> None:
    if values.get("critical"):
        raise ValueError(
            "critical must be False for defensivekv: its score holds CriticalKV's two stages"
        )


def defensive_scores(obs, kernel_size: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Steps 1-2: ``s`` [b, Hkv, P] (pooled, renormalised, max over queries and group, floored at the mean)
    and the unpooled attention averaged over the group and the window [b, Hkv, P]."""
    hkv = obs.keys.shape[1]
    P = obs.prefix_len
    A = obs.window_attention[..., :P]  # [b, Hq, w, P]
    mean_attention = group_view(A.mean(-2), hkv).mean(2)
    real = obs.key_valid[:, None, :P].float()
    pooled = pool1d(A, "avgpool", kernel_size).mul_(
        real[..., None, :]
    )  # nothing pooled onto padding
    pooled = pooled.div_(pooled.sum(-1, keepdim=True).clamp_min_(_TINY)).mul_(
        A.sum(-1, keepdim=True)
    )
    m = group_view(pooled.amax(-2), hkv).amax(2)
    floor = (m * real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp_min(1.0)
    return torch.maximum(m, floor), mean_attention


def first_stage(
    mean_attention: "torch.Tensor", threshold: "torch.Tensor", cap: int
) -> "torch.Tensor":
    """[b, Hkv, P] bool: each head's top entries by ``mean_attention`` before their share of the head's
    mass reaches ``threshold`` [b] (the entry that reaches it excluded), at most ``cap``."""
    p = mean_attention / mean_attention.sum(-1, keepdim=True).clamp_min(_TINY)
    ranked, order = p.sort(-1, descending=True)
    count = (
        (ranked.cumsum(-1) >= threshold[:, None, None]).int().argmax(-1).clamp_(max=max(cap, 0))
    )  # 0: never
    return order.argsort(-1) < count[..., None]


def score(obs, cfg):
    """DefensiveKV's score per KV head -> [b, Hkv, P] (first-stage entries: just above the layer's largest)."""
    hkv = obs.keys.shape[1]
    P = obs.prefix_len
    w = obs.window
    s, mean_attention = defensive_scores(obs, cfg.kernel_size)
    norms = group_view(obs.projected_value_norms(cfg.value_norm), hkv).mean(2)  # [b, Hkv, P]
    s = s * (norms / obs.every_head(norms).sum(1, keepdim=True).clamp_min(_TINY))
    bias = obs.every_head(obs.window_attention[..., max(0, P - w) : P].sum(-1)).mean(dim=(1, 2))  # [b]
    first = first_stage(mean_attention, cfg.first_stage_mass - bias, obs.budget - w)
    top = obs.every_head(s).amax(dim=(1, 2), keepdim=True)
    return torch.where(first, torch.nextafter(top, torch.full_like(top, float("inf"))), s)
