"""H2O: keep the heavy hitters, the entries with the largest attention accumulated over the prompt.

Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(Zhang et al., 2023), https://arxiv.org/abs/2306.14048.

``score`` recomputes every query's softmax (max, exponential, normalisation). Where the attention backend
returns each query's log-sum-exp (FlashAttention's ``softmax_lse``), ``column_sums`` forms the same sums
from it with one product and one exponential per block of queries, no second softmax.
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


def column_sums(obs, lse: "torch.Tensor") -> "torch.Tensor":
    """``score`` from each query's log-sum-exp: ``sum_q exp(l_qn - lse_q)`` over the keys n each query sees.

    ``lse`` [b, Hq, Lq] float32: the natural log-sum-exp of each held query's logits ``l_qn`` (scaled, after
    any softcap) over the keys it sees, as the attention backend computed it. Per block of queries (as
    ``score``): one product with the keys up to the block's last query, one exponential and the column
    sum; the causal mask covers the block's own keys only (about half ``score``'s product and passes over
    a prompt). Without padding (``obs.key_valid`` all true, one set of keys per head: the
    engine's layout). -> [b, Hq, P] float32.
    """
    b, hq, _, d = obs.queries.shape
    hkv, n = obs.keys.shape[1:3]
    block = max(1, (d * hkv) // hq)
    keys = obs.keys.float().transpose(-1, -2)  # [b, Hkv, d, n], once
    total = torch.zeros(b, hkv, hq // hkv, n, device=obs.keys.device)
    first = obs.first_query
    for start in range(first, n, block):
        stop = min(n, start + block)
        rows = stop - start
        q = obs.queries[:, :, start - first : stop - first].float()
        seen = keys[..., :stop]  # no query of the block sees a later key
        logits = (q.reshape(b, hkv, -1, d) @ seen).view(b, hkv, -1, rows, stop).mul_(obs.scaling)
        if obs.softcap:
            logits.div_(obs.softcap).tanh_().mul_(obs.softcap)
        logits.sub_(lse[:, :, start - first : stop - first].view(b, hkv, -1, rows, 1))
        future = torch.arange(start, stop, device=logits.device)
        logits[..., start:].masked_fill_(future > future[:, None], float("-inf"))
        total[..., :stop] += logits.exp_().sum(-2)
    return total.view(b, hq, n)[..., : obs.prefix_len]
