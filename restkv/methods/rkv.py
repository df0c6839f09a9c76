"""R-KV: keep the entries the recent queries attend to most and that repeat the other keys least.

Paper: "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (Cai et al., 2025),
https://arxiv.org/abs/2505.24133; code: https://github.com/Zefan-Cai/R-KV (``rkv/compression/r1_kv.py``,
``rkv/utils.py``). Made for long generations: the reference compresses the cache every 128 generated
tokens (``divide_length``) back to its budget, so this method's defaults evict while decoding
(``decode_interval=128``) with R-KV's budget of 128 entries and window of 8 (``window_size=8``: the queries
observed and the newest entries always kept).

An entry's score is ``mix_lambda * importance - (1 - mix_lambda) * redundancy``, per KV head:

- importance: the window queries' attention over the prefix, the logits of a GQA group reduced by their
  maximum before the softmax, the softmax over the prefix entries only, averaged over the window
  queries, then max-pooled over ``kernel_size`` (7) neighbouring positions;
- redundancy: the mean over every held key ``i`` (the window's included) of the cosine similarity of
  keys ``i`` and ``n``, with the diagonal zeroed and, for each ``i``, the entry of its most recent
  similar key (the last one above ``redundancy_threshold``; the first key when none) zeroed too, so that
  the newest of near-duplicates looks least redundant; then a softmax over all held keys.

``mix_lambda`` is 0.1, the paper's default and docs/usage.md's (the reference class's own default is 0.07).

Differences: every score in float32 (the reference rounds the importance to the model's dtype); the
scale of the logits is the layer's own (the reference's ``1 / sqrt(head_dim)``); padding and entries a
head does not hold are left out of both softmaxes and of the similarity means; the redundancy is
computed per sample (the reference reads batch element 0); the first eviction while decoding comes
``decode_interval`` tokens after the prefill (the reference's when the total length is a multiple of 128).
"""

from __future__ import annotations

from ..knobs import KERNEL_SIZE, POOLING, Knob
from ..lazy import torch
from ..scoring.observe import group_view
from ..scoring.smoothing import pool1d

SIMILARITY_BLOCK = 1 << 22  # float32 elements of a block of key similarities ([b, Hkv, rows, n])

KNOBS = (
    Knob(
        "mix_lambda",
        0.1,
        "R-KV: weight of the attention importance; 1 - mix_lambda weighs the key redundancy",
        rule="in [0, 1]",
    ),
    Knob(
        "redundancy_threshold",
        0.5,
        "R-KV: cosine similarity of two keys above which they are near-duplicates (the newest is spared)",
        rule="in [-1, 1]",
    ),
    POOLING.but(default="maxpool"),
    KERNEL_SIZE,
)


def score(obs, cfg):
    """``mix_lambda`` x importance - (1 - ``mix_lambda``) x redundancy -> [b, Hkv, P]."""
    importance = pool1d(_importance(obs), cfg.pooling, cfg.get("kernel_size", 1))
    redundancy = _redundancy(obs, cfg.redundancy_threshold)[..., : obs.prefix_len]
    return cfg.mix_lambda * importance - (1 - cfg.mix_lambda) * redundancy


def _importance(obs) -> "torch.Tensor":
    """[b, Hkv, P]: the window queries' softmax over the prefix of the group-max logits, averaged."""
    b, hq, _, d = obs.queries.shape
    hkv, P = obs.keys.shape[1], obs.prefix_len
    q = obs.queries[:, :, -obs.window :].float()
    k = obs.keys[:, :, :P].float()
    logits = group_view(q, hkv) @ k[:, :, None].transpose(-1, -2)  # [b, Hkv, g, w, P]
    logits = logits.amax(2) * obs.scaling
    if obs.softcap:
        logits = torch.tanh(logits / obs.softcap) * obs.softcap
    held = obs.entry_valid[..., :P][:, :, None]  # [b, 1 or Hkv, 1, P]
    logits = logits.masked_fill(~held, float("-inf"))
    return logits.softmax(-1).nan_to_num(0.0).mean(-2)


def _redundancy(obs, threshold: float) -> "torch.Tensor":
    """[b, Hkv, L]: softmax over the held keys of their mean similarity to the others (R-KV's
    ``cal_similarity``), the similarities computed a block of rows at a time."""
    keys = obs.keys.float()
    b, hkv, n, _ = keys.shape
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    held = obs.entry_valid.expand(b, hkv, n)
    first = held.long().argmax(-1, keepdim=True)  # [b, Hkv, 1] each head's first held key
    slots = torch.arange(n, device=keys.device)
    total = torch.zeros(b, hkv, n, device=keys.device)
    rows = max(1, SIMILARITY_BLOCK // (b * hkv * n))
    for s in range(0, n, rows):
        e = min(n, s + rows)
        sim = unit[:, :, s:e] @ unit.transpose(-1, -2)  # [b, Hkv, r, n]
        own = slots[s:e, None] == slots  # the diagonal
        sim = sim.masked_fill(own | ~held[:, :, None], 0.0)
        similar = (sim > threshold) & held[:, :, None]
        last = torch.where(similar, slots, -1).amax(-1, keepdim=True)  # [b, Hkv, r, 1]
        last = torch.where(last >= 0, last, first[:, :, None])
        sim = sim.scatter(-1, last, 0.0)  # the most recent near-duplicate of each row is spared
        total += (sim * held[:, :, s:e, None]).sum(-2)
    mean = total / held.sum(-1, keepdim=True).clamp_min(1)
    return mean.masked_fill(~held, float("-inf")).softmax(-1).nan_to_num(0.0)
