"""Compactor: blend the keys' statistical leverage with the chunked non-causal attention.

Paper: "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"
(Chari & Van Durme, 2025), https://arxiv.org/abs/2507.08143; code: kvpress ``CompactorPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/compactor_press.py``), whose definition this
is.

The first ``sink_tokens`` and the last ``recent_tokens`` tokens (the reference's ``sink_size_start``
and ``sink_size_end``) are left out: the other entries are scored by ``restkv.methods.leverage``
(``sketch_dimension``, ``sketch_seed``) and ``restkv.methods.noncausal`` (``attention_chunk``, the
reference's ``chunk_size``) as if the prompt held them alone (their means, Gram matrix, chunks and
z-scores run over them), and the score is ``blending * leverage + attention``; ``blending=None``
(the reference's default) is the layer's compression ratio ``1 - budget / L`` (L: the sample's real
tokens). The left-out tokens are always kept.

Differences: those of ``leverage`` and ``noncausal`` (per-sample statistics, a seeded sketch, the
window always kept); the protected tokens score the sample's largest score plus 1 (the reference:
the batch's largest, a tie that the top-k may break against one of them); while decoding the first
``sink_tokens`` entries held and the last ``recent_tokens`` are protected (the reference scores
only the prefill)."""

from __future__ import annotations

from dataclasses import replace

from ..knobs import Knob
from ..lazy import F, torch
from ..scoring.observe import NEG
from . import leverage, noncausal, streamingllm

KNOBS = (
    *leverage.KNOBS,
    *noncausal.KNOBS,
    streamingllm.KNOBS[0].but(
        default=8, help="first tokens always kept and left out of the scores"
    ),
    Knob(
        "recent_tokens",
        4,
        "last tokens always kept and left out of the scores",
        rule=">= 0",
    ),
    Knob(
        "blending",
        None,
        "weight of the leverage against the attention (None: the layer's compression ratio)",
        nullable=True,
        of=float,
        rule=">= 0",
    ),
)


def uses_budget(cfg) -> bool:
    """The default blending is the layer's compression ratio."""
    return cfg.blending is None


def sinks(obs, count: int) -> "torch.Tensor":
    """[b, L] bool: the first ``count`` real tokens."""
    return (obs.positions >= 0) & (obs.positions < count)


def middle(obs, cfg):
    """The observation of the entries before the last ``recent_tokens``, its sinks made padding
    (so the entries it holds are still left padded), no window, a memo of its own."""
    n = obs.keys.shape[2]
    cut = max(1, n - cfg.recent_tokens)
    queries = obs.queries[:, :, : max(0, obs.queries.shape[2] - (n - cut))]
    held = ~sinks(obs, cfg.sink_tokens)[:, :cut]
    head_valid = None if obs.head_valid is None else obs.head_valid[..., :cut] & held[:, None]
    return replace(
        obs,
        queries=queries,
        keys=obs.keys[:, :, :cut],
        values=obs.values[:, :, :cut],
        key_valid=obs.key_valid[:, :cut] & held,
        head_valid=head_valid,
        window=0,
        memo={},
    )


def blending(obs, cfg) -> "torch.Tensor | float":
    """``cfg.blending``, else ``1 - budget / L`` [b, 1, 1] per sample's real tokens L."""
    if cfg.blending is not None:
        return cfg.blending
    real = obs.key_valid.sum(-1, dtype=torch.float32)[:, None, None]
    return (1 - obs.budget / real.clamp_min(1)).clamp_min(0)


def score(obs, cfg):
    """``blending * leverage + attention`` of the middle entries, the others above them
    -> [b, Hkv, P]."""
    n = obs.keys.shape[2]
    P = obs.prefix_len
    inner = middle(obs, cfg)
    s = leverage.score(inner, cfg).mul_(blending(obs, cfg))
    if inner.queries.shape[2] > 0:  # none while decoding with a window of at most recent_tokens
        s = s.add_(noncausal.score(inner, cfg))
    scored = inner.entry_valid.expand_as(s)  # [b, Hkv, L'] the entries scored
    top = s.masked_fill(~scored, NEG).amax((1, 2), keepdim=True)  # [b, 1, 1]
    right = n - s.shape[2]
    s = F.pad(s, (0, right))[..., :P]
    scored = F.pad(scored, (0, right))[..., :P]
    return torch.where(scored | ~obs.entry_valid[..., :P], s, top + 1)
