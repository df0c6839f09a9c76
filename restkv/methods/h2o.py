"""H2O: keep the heavy hitters, the entries with the largest attention accumulated over the prompt.

Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(Zhang et al., 2023), https://arxiv.org/abs/2306.14048.

``score`` recomputes every query's softmax (max, exponential, normalisation) over every key, padding
and per-head entries masked. ``column_sums`` forms the same sums in the engine's layout (``restkv.vllm``:
no padding, one set of keys per head), one product per block of queries over the keys it sees, the causal
mask on the block's own keys only; from each query's log-sum-exp where the attention backend returns it
(FlashAttention's ``softmax_lse``: one exponential, no second softmax), else with one softmax in place.
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


def column_sums(obs, lse: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``score`` in the engine's layout: ``sum_q softmax_n(l_qn)`` over the keys n each query sees
    -> [b, Hq, P] float32, equal to ``score`` within float32 rounding.

    ``lse`` [b, Hq, Lq] float32: the natural log-sum-exp of each held query's logits ``l_qn`` (scaled,
    after any softcap) over the keys it sees, as the attention backend computed it; the sums are then
    ``sum_q exp(l_qn - lse_q)`` (one exponential, no max, no normalisation). Without it, one softmax of
    each block (max, exponential and normalisation fused), in place. Per block of queries (``score``'s
    size: about one float32 key tensor of logits): the scale (and softcap) folded into its queries, one
    product with the keys up to its last query, the causal mask on its own keys only ([rows, rows];
    about half ``score``'s product and passes over a prompt), the column sum. Without padding
    (``obs.key_valid`` all true, one set of keys per head).
    """
    b, hq, _, d = obs.queries.shape
    hkv, n = obs.keys.shape[1:3]
    block = max(1, (d * hkv) // hq)
    keys = obs.keys.float().transpose(-1, -2)  # [b, Hkv, d, n], once
    scale = obs.scaling / (obs.softcap or 1.0)
    total = torch.zeros(b, hkv, hq // hkv, n, device=obs.keys.device)
    first = obs.first_query
    for start in range(first, n, block):
        stop = min(n, start + block)
        rows = stop - start
        q = obs.queries[:, :, start - first : stop - first].float().mul(scale)
        seen = keys[..., :stop]  # no query of the block sees a later key
        logits = (q.reshape(b, hkv, -1, d) @ seen).view(b, hkv, -1, rows, stop)
        if obs.softcap:
            logits.tanh_().mul_(obs.softcap)
        future = torch.arange(start, stop, device=logits.device)
        logits[..., start:].masked_fill_(future > future[:, None], float("-inf"))
        if lse is None:
            probs = torch.softmax(logits, -1, out=logits)
        else:
            own = lse[:, :, start - first : stop - first].view(b, hkv, -1, rows, 1)
            probs = logits.sub_(own).exp_()
        total[..., :stop] += probs.sum(-2)
        del logits, probs  # one block held at a time
    return total.view(b, hq, n)[..., : obs.prefix_len]
