"""From scores to a compressed layer: GQA reduction, top-B per KV head, window, optional merging."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import CompressionConfig
from .merge import pivot_merge
from .observation import Observation, group_view
from .scorers import SCORERS, cam


@dataclass
class Compressed:
    keys: Tensor  # [b, Hkv, B, d]
    values: Tensor  # [b, Hkv, B, d]
    positions: Tensor  # [b, Hkv, B] position from the sample's first real token, -1 on padding
    valid: Tensor  # [b, B] bool, False on kept padding (same for every head)


def reduce_groups(scores: Tensor, hkv: int, how: str) -> Tensor:
    """Per-query-head scores [b, Hq, P] -> per-KV-head [b, Hkv, P] (``mean`` or ``max`` over each group)."""
    if scores.shape[1] in (1, hkv):  # already per KV head, or shared by all heads
        return scores
    grouped = group_view(scores, hkv)
    return grouped.mean(2) if how == "mean" else grouped.amax(2)


def head_scores(obs: Observation, cfg: CompressionConfig, wo: Tensor | None = None) -> Tensor:
    """Scores of the prefix entries per KV head [b, Hkv, P]; padding scores -inf."""
    if cfg.method == "restkv":
        s = SCORERS["restkv"](obs, cfg, wo)
    else:
        s = SCORERS[cfg.method](obs, cfg)
    s = reduce_groups(s, obs.keys.shape[1], cfg.gqa_agg).expand(obs.keys.shape[0], obs.keys.shape[1], -1)
    return s.masked_fill(~obs.key_valid[:, None, : obs.prefix_len], float("-inf"))


def compress(obs: Observation, cfg: CompressionConfig, wo: Tensor | None = None) -> Compressed:
    """Keep the top ``budget - window`` prefix entries of each KV head, plus the window, in position order."""
    b, hkv, n, d = obs.keys.shape
    if n <= obs.budget:
        idx = torch.arange(n, device=obs.keys.device).expand(b, hkv, n)
        keys, values, scores = obs.keys, obs.values, None
    else:
        scores = head_scores(obs, cfg, wo)
        top = scores.topk(obs.budget - obs.window, dim=-1).indices.sort(-1).values
        window = torch.arange(obs.prefix_len, n, device=top.device).expand(b, hkv, -1)
        idx = torch.cat([top, window], -1)
        keys, values = _gather(obs.keys, idx), _gather(obs.values, idx)
    if scores is not None and cfg.method == "cam":
        kept = torch.zeros(b, hkv, n, dtype=torch.bool, device=idx.device).scatter_(2, idx, True)
        values = _gather(cam.merged_values(obs, scores.clamp_min(0), kept), idx)
    if scores is not None and cfg.merge == "pivot":
        evicted = torch.ones(b, hkv, n, dtype=torch.bool, device=idx.device).scatter_(2, idx, False)
        keys, values = pivot_merge(obs.keys, obs.values, idx, evicted & obs.key_valid[:, None])
    valid = obs.key_valid.gather(1, idx[:, 0])
    positions = obs.positions[:, None].expand(b, hkv, n).gather(2, idx).masked_fill(~valid[:, None], -1)
    return Compressed(keys, values, positions, valid)


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    return x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))
