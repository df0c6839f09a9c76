"""H2O: keep the heavy hitters, the entries with the largest attention accumulated over the prompt.

Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(Zhang et al., 2023), https://arxiv.org/abs/2306.14048.
"""

from __future__ import annotations

import dataclasses

from ..knobs import GQA_AGG
from ..lazy import torch

KNOBS = (GQA_AGG,)


def score(obs, cfg):
    """Attention summed over every query held (the prompt's at prefill, the window's when decoding), each
    query only over the keys it can see -> [b, Hq, P].

    Queries are processed in blocks of about one key tensor's size of float32 attention; low-precision keys
    are converted to float32 once (not once per block), so the extra memory is about twice the layer's K+V
    in bf16 and the conversion is O(L d), not O(L^2 d / block).
    """
    b, hq, _, d = obs.queries.shape
    n = obs.keys.shape[2]
    block = max(1, (d * obs.keys.shape[1]) // hq)
    keys = obs.keys.float()  # the keys themselves when already float32
    exact = obs if keys is obs.keys else dataclasses.replace(obs, keys=keys, memo={})
    total = torch.zeros(b, hq, n, device=obs.keys.device)
    for start in range(obs.first_query, n, block):
        total += exact.attention(start, min(n, start + block)).sum(-2)
    return total[..., : obs.prefix_len]
