"""SnapKV: keep the entries the observation window attends to most, after pooling.

Paper: "SnapKV: LLM Knows What You are Looking for Before Generation" (Li et al., 2024),
https://arxiv.org/abs/2404.14469. PyramidKV, AdaKV, HeadKV, CriticalKV and ChunkKV use the same score
with their budgets and selection. ``window_reduce``: the window queries' attention summed (the SnapKV and
KVCache-Factory code) or averaged (kvpress); the order is the same, the scale matters where a constant is
added to the scores (CriticalKV's epsilon).
"""

from __future__ import annotations

from ..knobs import GQA_AGG, KERNEL_SIZE, POOLING, Knob
from ..scoring.smoothing import pool1d

KNOBS = (
    POOLING.but(default="avgpool"),
    KERNEL_SIZE,
    GQA_AGG,
    Knob(
        "window_reduce",
        "sum",
        "the window queries' attention summed (SnapKV's code) or averaged (kvpress)",
        choices=("sum", "mean"),
    ),
)


def score(obs, cfg):
    """Window attention summed (or averaged) over the window queries, pooled -> [b, Hq, P]."""
    a = obs.window_attention[..., : obs.prefix_len]
    a = a.mean(-2) if cfg.window_reduce == "mean" else a.sum(-2)
    return pool1d(a, cfg.pooling, cfg.get("kernel_size", 1))
