"""LagKV: score each partition of the prompt against the next one (lag-relative statistics).

Paper: "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important" (Liang et
al., 2025), https://arxiv.org/abs/2504.04704; code: kvpress ``LagKVPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/lagkv_press.py``), whose definition this is.

After the first ``sink_tokens`` tokens (the reference's ``n_sink``) the prompt is cut into
partitions of ``lag_size`` tokens; the last full partition and the remainder after it (the tail) are
always kept, as are the sinks. Every other partition is scored against the next: per KV head and
channel, its keys are min-max normalised by the next partition's keys' range, an entry's key score
is the standard deviation of its normalised key over the channels, softmaxed over the partition; the
value score likewise; the score is their mean. Without ``cross_scoring`` it is replaced by its rank
inside its partition over ``lag_size`` (each partition then loses as many entries as the others
under a uniform budget). A prompt shorter than ``sink_tokens + 2 lag_size`` is scored by recency
(nothing else to compare with). Query-free.

Differences: partitions count from each sample's first real token (the reference: from the tensor's
first index, the same without padding); a channel whose range in the next partition is zero divides
by 1e-30 (the reference gets NaN there); the scores are float32 (the reference: the model dtype);
the observation window is always kept (the reference keeps none; ``window_size=1`` comes
closest).
"""

from __future__ import annotations

from ..scoring import observe
from ..knobs import Knob
from ..lazy import torch
from . import streamingllm
from .partition import chunk_slots, gather_slots

KNOBS = (
    streamingllm.KNOBS[0],
    Knob(
        "lag_size",
        128,
        "tokens per partition (each scored against the next)",
        rule=">= 2",
    ),
    Knob(
        "cross_scoring",
        False,
        "keep the softmaxed scores (comparable across partitions and heads) instead of "
        "their rank inside each partition",
    ),
)


def partition_scores(x, index, lag: int) -> "torch.Tensor":
    """The lag-relative score [b, H, m - 1, lag] of partitions 0..m-2 of x [b, H, L, d]
    (partition j's entries ``index[:, j]``), each against partition j + 1's range."""
    m = index.shape[1]
    block = max(1, observe.VALUE_BLOCK // lag)
    lo = []
    hi = []
    for c in range(1, m, block):
        part = gather_slots(x, index[:, c : c + block])
        lo.append(part.amin(3))
        hi.append(part.amax(3))
    lo = torch.cat(lo, 2)  # [b, H, m - 1, d]: the range of partition j + 1, for j = 0..m-2
    span = (torch.cat(hi, 2) - lo).clamp_min_(1e-30)
    out = []
    for c in range(0, m - 1, block):
        e = min(m - 1, c + block)
        part = gather_slots(x, index[:, c:e])
        normalised = part.sub_(lo[:, :, c:e, None]).div_(span[:, :, c:e, None])
        out.append(normalised.std(-1).softmax(-1))
    return torch.cat(out, 2)


def score(obs, cfg):
    """Sinks and tail 1, the other partitions' entries their lag-relative score (or its rank)
    -> [b, Hkv, P]."""
    b, hkv, n, _ = obs.keys.shape
    lag = cfg.lag_size
    sinks = cfg.sink_tokens
    pos = obs.positions[:, None]  # [b, 1, L]
    real = obs.key_valid.sum(-1)[:, None, None]  # [b, 1, 1]
    recency = (pos - sinks) / (real - sinks).clamp_min(1)  # the short prompts' scores
    out = torch.zeros(b, hkv, n, device=obs.keys.device)
    if n >= sinks + 2 * lag:
        index, _ = chunk_slots(obs.key_valid, lag, sinks)
        s = (partition_scores(obs.keys, index, lag) + partition_scores(obs.values, index, lag)) / 2
        if not cfg.cross_scoring:
            s = s.argsort(-1).argsort(-1).float() / lag
        scored = index[:, :-1].reshape(b, 1, -1).expand(b, hkv, -1)
        out.scatter_(2, scored, s.reshape(b, hkv, -1))
    tail = sinks + ((real - sinks).clamp_min(0) // lag - 1) * lag  # first position of the tail
    out = torch.where(pos >= tail, 1.0, out)
    out = torch.where(real < sinks + 2 * lag, recency, out)
    out = torch.where((pos >= 0) & (pos < sinks), 1.0, out)
    return out[..., : obs.prefix_len]
