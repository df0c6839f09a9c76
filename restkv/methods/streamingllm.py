"""StreamingLLM: keep the first ``sink_tokens`` tokens (attention sinks) and the most recent ones.

Paper: "Efficient Streaming Language Models with Attention Sinks" (Xiao et al., 2023),
https://arxiv.org/abs/2309.17453.
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch

KNOBS = (Knob("sink_tokens", 4, "first tokens always kept", rule=">= 0"),)


def check(cfg):
    if cfg["sink_tokens"] > cfg.get("max_capacity_prompt", float("inf")) - cfg["window_size"]:
        raise ValueError(
            f"sink_tokens must be in [0, max_capacity_prompt - window_size], got {cfg['sink_tokens']}"
        )


def score(obs, cfg):
    """Recency, with the sinks above everything -> [b, 1, P] (shared by all heads)."""
    pos = obs.positions[:, : obs.prefix_len].float()
    sinks = (pos >= 0) & (pos < cfg.sink_tokens)
    return torch.where(sinks, torch.finfo(torch.float32).max, pos)[:, None, :]
