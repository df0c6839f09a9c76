"""SnapKV: keep the entries the observation window attends to most, after pooling.

Paper: "SnapKV: LLM Knows What You are Looking for Before Generation" (Li et al., 2024),
https://arxiv.org/abs/2404.14469. PyramidKV uses the same score with its layer budgets.
"""

from __future__ import annotations

from torch import Tensor

from ..config import CompressionConfig
from ..observation import Observation
from ..smoothing import pool1d


def score(obs: Observation, cfg: CompressionConfig) -> Tensor:
    """Window attention summed over the window queries, pooled -> [b, Hq, P]."""
    a = obs.window_attention[..., : obs.prefix_len].sum(-2)
    return pool1d(a, cfg.pooling, cfg.kernel_size)
