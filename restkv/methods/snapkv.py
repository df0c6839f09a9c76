"""SnapKV: keep the entries the observation window attends to most, after pooling.

Paper: "SnapKV: LLM Knows What You are Looking for Before Generation" (Li et al., 2024),
https://arxiv.org/abs/2404.14469. PyramidKV, AdaKV and HeadKV use the same score with their budgets.
"""

from __future__ import annotations

from ..knobs import GQA_AGG, KERNEL_SIZE, POOLING
from ..smoothing import pool1d

KNOBS = (POOLING.but(default="avgpool"), KERNEL_SIZE, GQA_AGG)


def score(obs, cfg):
    """Window attention summed over the window queries, pooled -> [b, Hq, P]."""
    a = obs.window_attention[..., : obs.prefix_len].sum(-2)
    return pool1d(a, cfg.pooling, cfg.get("kernel_size", 1))
