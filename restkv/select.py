"""From scores to the kept entries: GQA reduction, per-head budgets, top-B per KV head, window, merging."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .budgets import head_sizes
from .config import CompressionConfig
from .merge import merge
from .observe import Observation, group_view


@dataclass
class Kept:
    """The entries a layer keeps."""

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


def raw_scores(obs: Observation, cfg: CompressionConfig) -> Tensor:
    """The method's scores [b, Hq or Hkv, P] (or [b, 1, P]), from ``obs.memo`` when already computed.

    The memo key is everything the score can read: its module, the window, the values of the knobs
    it declares (the only ones it is given) and, if it declares that it reads it, the layer's budget.
    Configs that differ only in how they select from the scores (budget, GQA reduction, per-head
    budgets, merging) share them: SnapKV's (also PyramidKV/AdaKV/HeadKV's) and H2O's are computed
    once for all budgets in sweep mode.
    """
    method, knobs = cfg.scorer, cfg.score_knobs()
    key = ("scores", method.scorer, obs.window, knobs, obs.budget if method.uses_budget(knobs) else None)
    if key not in obs.memo:
        obs.memo[key] = method.score(obs, knobs)
    return obs.memo[key]


def head_scores(obs: Observation, cfg: CompressionConfig) -> Tensor:
    """Scores of the prefix entries per KV head [b, Hkv, P]; padding scores -inf."""
    b, hkv = obs.keys.shape[:2]
    s = reduce_groups(raw_scores(obs, cfg), hkv, cfg.get("gqa_agg", "mean")).expand(b, hkv, -1)
    return s.masked_fill(~obs.key_valid[:, None, : obs.prefix_len], float("-inf"))


def select(obs: Observation, cfg: CompressionConfig, table: Tensor | None = None) -> Kept:
    """Keep the top prefix entries of each KV head, plus the window, in position order, then merge.

    Each head keeps ``budget - window`` prefix entries, or its own number with per-head budgets
    (``budgets.head_sizes``: AdaKV from the scores, HeadKV from the layer's ``table`` row [Hkv]).
    """
    b, hkv, n, d = obs.keys.shape
    if n <= obs.budget:
        idx = torch.arange(n, device=obs.keys.device).expand(b, hkv, n)
        keys, values, sizes = obs.keys, obs.values, None
    else:
        scores = head_scores(obs, cfg)
        base = obs.budget - obs.window
        sizes = head_sizes(cfg, scores, base, table)
        idx = _top_then_window(scores, base if sizes is None else sizes, obs.window)
        keys, values = merge(cfg, obs, scores, idx, _gather(obs.keys, idx), _gather(obs.values, idx))
    positions = obs.positions[:, None].expand(b, hkv, n).gather(2, idx)
    if sizes is None:
        valid = obs.key_valid.gather(1, idx[:, 0])
        return Kept(keys, values, positions.masked_fill(~valid[:, None], -1), valid)
    in_head = torch.arange(idx.shape[-1], device=idx.device) < (sizes + obs.window)[..., None]
    valid = in_head & obs.key_valid[:, None].expand(b, hkv, n).gather(2, idx)
    return Kept(keys, values, positions.masked_fill(~valid, -1), valid, per_head=True)


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
