"""StreamingLLM: keep the first ``sink_tokens`` tokens (attention sinks) and the most recent ones.

Paper: "Efficient Streaming Language Models with Attention Sinks" (Xiao et al., 2023),
https://arxiv.org/abs/2309.17453.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import CompressionConfig
from ..observation import Observation


def score(obs: Observation, cfg: CompressionConfig) -> Tensor:
    """Recency, with the sinks above everything -> [b, 1, P] (shared by all heads)."""
    pos = obs.positions[:, : obs.prefix_len].float()
    sinks = (pos >= 0) & (pos < cfg.sink_tokens)
    return torch.where(sinks, torch.finfo(torch.float32).max, pos)[:, None, :]
