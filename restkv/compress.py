"""From scores to a compressed layer: GQA reduction, top-B per KV head, window, optional merging."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .budgets import adakv_budgets
from .config import CompressionConfig
from .merge import pivot_merge
from .observation import Observation, group_view
from .scorers import SCORERS, cam, restkv


@dataclass
class Compressed:
    keys: Tensor  # [b, Hkv, B, d] (B: the longest head's length when heads differ)
    values: Tensor  # [b, Hkv, B, d]
    positions: Tensor  # [b, Hkv, B] position from the sample's first real token, -1 on padding
    valid: Tensor  # [b, B] bool, False on kept padding (same for every head); [b, Hkv, B] with per-head budgets
    per_head: bool = False  # heads keep different numbers of entries


def reduce_groups(scores: Tensor, hkv: int, how: str) -> Tensor:
    """Per-query-head scores [b, Hq, P] -> per-KV-head [b, Hkv, P].

    ``mean`` / ``max`` over each GQA group (``mean`` is the original's behaviour). The scale-free
    variants first put every query head on one scale, so a head whose scores are larger (for ReST-KV:
    a larger ``||W_O^h||``) does not decide for its group: ``sum_norm`` divides each head's scores by
    their sum, ``rank`` replaces them by their rank / P; then the group mean.
    """
    if scores.shape[1] in (1, hkv):  # already per KV head, or shared by all heads
        return scores
    if how == "sum_norm":
        scores = scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    elif how == "rank":
        scores = scores.argsort(-1).argsort(-1).float() / scores.shape[-1]
    grouped = group_view(scores, hkv)
    return grouped.amax(2) if how == "max" else grouped.mean(2)


SCORE_KNOBS = ("window_size", "kernel_size", "pooling", "use_wo", "use_norm", "use_ema", "alpha", "metric_mode",
               "tau", "scale", "sink_tokens")  # every knob a scorer reads


def raw_scores(obs: Observation, cfg: CompressionConfig, wo: Tensor | None = None, memo: dict | None = None) -> Tensor:
    """The scorer's output [b, Hq or Hkv, P].

    ``memo``, one dict per layer and prompt (sweep mode keeps one), lets configs that differ only in
    how they select from the scores (budget, GQA reduction, per-head budgets, merging) share them:
    H2O's, SnapKV's (also PyramidKV/AdaKV/HeadKV's) are computed once for all budgets.
    """
    scorer = SCORERS[cfg.method]
    key = (scorer, obs.budget if scorer is restkv.score else None, *(getattr(cfg, k) for k in SCORE_KNOBS))
    if memo is not None and key in memo:
        return memo[key]
    s = scorer(obs, cfg, wo) if scorer is restkv.score else scorer(obs, cfg)
    if memo is not None:
        memo[key] = s
    return s


def head_scores(obs: Observation, cfg: CompressionConfig, wo: Tensor | None = None, memo: dict | None = None) -> Tensor:
    """Scores of the prefix entries per KV head [b, Hkv, P]; padding scores -inf."""
    b, hkv = obs.keys.shape[:2]
    s = reduce_groups(raw_scores(obs, cfg, wo, memo), hkv, cfg.gqa_agg).expand(b, hkv, -1)
    return s.masked_fill(~obs.key_valid[:, None, : obs.prefix_len], float("-inf"))


def compress(
    obs: Observation, cfg: CompressionConfig, wo: Tensor | None = None, head_budget: Tensor | None = None,
    memo: dict | None = None,
) -> Compressed:
    """Keep the top prefix entries of each KV head, plus the window, in position order.

    Each head keeps ``budget - window`` prefix entries, or its own number with per-head budgets
    (AdaKV from the scores, HeadKV from ``head_budget`` [Hkv]).
    """
    b, hkv, n, d = obs.keys.shape
    per_head = None
    if n <= obs.budget:
        idx = torch.arange(n, device=obs.keys.device).expand(b, hkv, n)
        keys, values, scores = obs.keys, obs.values, None
    else:
        scores = head_scores(obs, cfg, wo, memo)
        base = obs.budget - obs.window
        if cfg.head_budget == "adakv":
            per_head = adakv_budgets(scores, base, cfg.floor, cfg.normalize)
        elif cfg.head_budget == "headkv":
            per_head = head_budget.to(scores.device).clamp(max=obs.prefix_len).expand(b, hkv)
        idx = _top_then_window(scores, base if per_head is None else per_head, obs.window)
        keys, values = _gather(obs.keys, idx), _gather(obs.values, idx)
    if scores is not None and cfg.method == "cam":
        kept = torch.zeros(b, hkv, n, dtype=torch.bool, device=idx.device).scatter_(2, idx, True)
        values = _gather(cam.merged_values(obs, scores.clamp_min(0), kept), idx)
    if scores is not None and cfg.merge == "pivot":
        evicted = torch.ones(b, hkv, n, dtype=torch.bool, device=idx.device).scatter_(2, idx, False)
        keys, values = pivot_merge(obs.keys, obs.values, idx, evicted & obs.key_valid[:, None])
    positions = obs.positions[:, None].expand(b, hkv, n).gather(2, idx)
    if per_head is None:
        valid = obs.key_valid.gather(1, idx[:, 0])
        return Compressed(keys, values, positions.masked_fill(~valid[:, None], -1), valid)
    in_head = torch.arange(idx.shape[-1], device=idx.device) < (per_head + obs.window)[..., None]
    valid = in_head & obs.key_valid[:, None].expand(b, hkv, n).gather(2, idx)
    return Compressed(keys, values, positions.masked_fill(~valid, -1), valid, per_head=True)


def _top_then_window(scores: Tensor, keep, window: int) -> Tensor:
    """Indices [b, Hkv, K + window]: each head's top ``keep`` prefix entries in order, then the window.

    ``keep`` is an int, or [b, Hkv] per-head counts; then K is the largest count and each head's row is
    [its entries, the window, filler] (filler repeats the last position and is marked invalid later).
    """
    b, hkv, P = scores.shape
    window_idx = torch.arange(P, P + window, device=scores.device)
    if isinstance(keep, int):
        top = scores.topk(keep, dim=-1).indices.sort(-1).values
        return torch.cat([top, window_idx.expand(b, hkv, -1)], -1)
    order = scores.argsort(-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(P, device=order.device).expand_as(order))
    width = int(keep.max()) + window  # one host read per layer
    pos = torch.arange(P, device=order.device).expand_as(order)
    top = torch.where(rank < keep[..., None], pos, P + window - 1).sort(-1).values
    top = torch.nn.functional.pad(top, (0, max(0, width - P)), value=P + window - 1)[..., :width]
    j = torch.arange(width, device=order.device)
    in_window = (j >= keep[..., None]) & (j < keep[..., None] + window)
    return torch.where(in_window, P + j - keep[..., None], top)


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    return x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))
