"""CaM: evict by window attention, then merge each evicted value into the entries that follow it.

Paper: "CaM: Cache Merging for Memory-efficient LLMs Inference" (Zhang et al., ICML 2024),
https://proceedings.mlr.press/v235/zhang24n.html.

The original merges token by token with Bernoulli draws of probability ``p_e`` (the evicted entry's
attention over the largest attention of the kept ones) into the next ``m = window_size`` positions.
Here the merge uses the expectation ``p_e`` (deterministic) and the original values (no cascade),
on a copy: the values that produced the prefill output are never modified.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import CompressionConfig
from ..observation import Observation


def score(obs: Observation, cfg: CompressionConfig) -> Tensor:
    """Window attention summed over the window queries, unpooled -> [b, Hq, P]."""
    return obs.window_attention[..., : obs.prefix_len].sum(-2)


def merged_values(obs: Observation, scores: Tensor, kept: Tensor) -> Tensor:
    """Values of all L positions after merging evicted prefix entries forward -> [b, Hkv, L, d].

    ``scores`` [b, Hkv, P] (the selection scores), ``kept`` [b, Hkv, L] bool.
    Position j receives ``sum_{e in [j - m, j - 1], evicted} p_e v_e / m``.
    """
    m, P = obs.window, obs.prefix_len
    values = obs.values.float()
    s = scores.clamp_min(0)
    top = s.masked_fill(~kept[..., :P], 0).amax(-1, keepdim=True)
    p = (s / top.clamp_min(torch.finfo(torch.float32).tiny)).clamp(max=1.0)
    p = p * (~kept[..., :P]) * obs.key_valid[:, None, :P]
    src = torch.zeros_like(values[..., 0])
    src[..., :P] = p
    contrib = values * src[..., None] / m  # [b, Hkv, L, d]
    csum = torch.nn.functional.pad(contrib.cumsum(2), (0, 0, 1, 0))  # csum[j] = sum_{e < j}
    j = torch.arange(values.shape[2], device=values.device)
    lo = (j - m).clamp_min(0)
    incoming = csum[:, :, j] - csum[:, :, lo]
    return (values + incoming).to(obs.values.dtype)
