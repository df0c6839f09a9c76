"""H2O: keep the heavy hitters, the entries with the largest attention accumulated over the prompt.

Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(Zhang et al., 2023), https://arxiv.org/abs/2306.14048.
"""

from __future__ import annotations

from ..knobs import GQA_AGG
from ..lazy import torch

KNOBS = (GQA_AGG,)


def score(obs, cfg):
    """Attention summed over every query held (the prompt's at prefill, the window's when decoding), each
    query only over the keys it can see -> [b, Hq, P].

    Queries are processed in blocks so the extra memory stays about one key tensor.
    """
    b, hq, _, d = obs.queries.shape
    n = obs.keys.shape[2]
    block = max(1, (d * obs.keys.shape[1]) // hq)
    total = torch.zeros(b, hq, n, device=obs.keys.device)
    for start in range(obs.first_query, n, block):
        total += obs.attention(start, min(n, start + block)).sum(-2)
    return total[..., : obs.prefix_len]
