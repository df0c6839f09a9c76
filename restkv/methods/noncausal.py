"""Non-causal attention: keep the entries most attended by the prompt's queries inside its chunks.

Paper: "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"
(Chari & Van Durme, 2025), https://arxiv.org/abs/2507.08143; code: kvpress ``NonCausalAttnPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/non_causal_attention_press.py``), whose
definition this is.

The prompt is cut into chunks of ``attention_chunk`` tokens (the reference's ``chunk_size``; here
``chunk_size`` is ChunkKV's selection knob); inside a chunk every query attends to every key of the
chunk (no causal mask), with the softmax of the raw dot products ``q.k`` (as the reference: no
1/sqrt(d) scaling, queries and keys after RoPE). An entry's attention is the sum over its chunk's
queries, averaged over the query heads of a GQA group, times ``||v||``, smoothed by an average over
3 neighbours (zero beyond the ends) and z-scored over the sample's entries.

Differences: chunks count from each sample's first real token and a partial last chunk holds only
real tokens (the reference pads it with zero queries and keys that it masks only in part: its
padding queries add ``1 / chunk_size`` per padding row to every key of the last chunk, and its
padding keys, given the logit -1e-9, take a share of every row; the reference's chunks are otherwise
the same); the z-score runs over each sample's real tokens (the reference: the batch's); the
observation window is always kept (the reference keeps none; ``window_size=1`` comes closest). While
decoding only the window's queries are held: they alone attend, inside their chunks."""

from __future__ import annotations

from ..scoring import observe
from ..knobs import Knob
from ..lazy import F, torch
from ..scoring.observe import NEG
from .leverage import zscore
from .partition import chunk_slots, gather_slots

KNOBS = (
    Knob(
        "attention_chunk",
        256,
        "tokens per chunk of the non-causal attention",
        rule=">= 1",
    ),
)


def chunk_attention(obs, size: int) -> "torch.Tensor":
    """Column sums [b, Hkv, g, L] of the non-causal attention inside chunks of ``size`` tokens."""
    b, hkv, n, d = obs.keys.shape
    first = obs.first_query
    g = obs.queries.shape[1] // hkv
    index, held = chunk_slots(obs.key_valid, size)  # [b, m, s]
    m = index.shape[1]
    asks = held & (index >= first)  # the slots whose query is held
    out = torch.zeros(b, hkv, g, n, device=obs.keys.device)
    block = max(1, observe.VALUE_BLOCK // (size * g))
    for c in range(0, m, block):
        idx = index[:, c : c + block]
        keys_in = held[:, c : c + block]  # [b, c, s] the slots holding a key
        asks_in = asks[:, c : c + block]
        q = gather_slots(obs.queries, (idx - first).clamp_min(0))  # [b, Hq, c, s, d]
        q = q.view(b, hkv, g, *q.shape[2:])
        k = gather_slots(obs.keys, idx)[:, :, None]  # [b, Hkv, 1, c, s, d]
        logits = (q @ k.transpose(-1, -2)).masked_fill_(~keys_in[:, None, None, :, None], NEG)
        a = logits.softmax(-1).mul_(asks_in[:, None, None, :, :, None]).sum(-2)  # [b, Hkv, g, c, s]
        flat = idx.reshape(b, 1, 1, -1).expand(b, hkv, g, -1)
        out.scatter_add_(3, flat, a.reshape(b, hkv, g, -1).mul_(keys_in.reshape(b, 1, 1, -1)))
    return out


def score(obs, cfg):
    """Chunked non-causal attention x ||v||, smoothed over 3 neighbours, z-scored -> [b, Hkv, P]."""
    b, hkv, n, _ = obs.keys.shape
    a = chunk_attention(obs, cfg.attention_chunk).mean(2)  # [b, Hkv, L]
    s = a * torch.linalg.vector_norm(obs.values, dim=-1, dtype=torch.float32)
    valid = obs.entry_valid.expand(b, hkv, n)
    s = F.avg_pool1d(s.mul_(valid).view(b * hkv, 1, n), 3, stride=1, padding=1).view(b, hkv, n)
    return zscore(s, valid)[..., : obs.prefix_len]
