"""Leverage: keep the keys of largest approximate statistical leverage (geometric outliers).

Paper: "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"
(Chari & Van Durme, 2025), https://arxiv.org/abs/2507.08143; code: kvpress ``LeverageScorePress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/leverage_press.py``), whose definition this
is.

Per KV head, the keys before RoPE are centred over the head's entries and sketched, ``X = (K - mean)
Phi`` with ``Phi`` a Gaussian d x ``sketch_dimension`` matrix scaled by 1/sqrt(sketch_dimension); an
entry's score is its leverage ``x_n^T (X^T X + 0.01 I)^{-1} x_n`` (the reference's Cholesky with its
first jitter, 0.01), then z-scored (minus the mean, over the standard deviation, of the sample's
scores). Query-free.

Differences: the mean, the Gram matrix and the z-score run over each sample's real tokens (the
reference: the batch's, padding included; the same for one sample without padding); the sketch is
seeded (``sketch_seed``, one per layer, shared by its samples and heads: the reference draws one
per sample and head from the global random state); the keys before RoPE are the layer's keys with its RoPE
undone (the reference recomputes them from the hidden states: equal up to the model dtype's
rounding); the jitter is never raised (0.01 I keeps the Gram matrix positive definite; the Gram
matrix and its factor are in float64); the observation window is always kept (the reference keeps
none; ``window_size=1`` comes closest)."""

from __future__ import annotations

from ..scoring import observe
from ..knobs import Knob
from ..lazy import torch
from .cur import SKETCH_SEED, sketch

JITTER = 1e-2  # the reference's first (and, for a positive semi-definite Gram matrix, only) jitter

KNOBS = (
    Knob(
        "sketch_dimension",
        48,
        "columns of the Gaussian sketch of the keys",
        rule=">= 1",
    ),
    SKETCH_SEED,
)


def prerope_blocks(obs):
    """(start, keys before RoPE [b, Hkv, m, d] float32), ``VALUE_BLOCK`` entries at a time."""
    n = obs.keys.shape[2]
    for s in range(0, n, observe.VALUE_BLOCK):
        e = min(n, s + observe.VALUE_BLOCK)
        keys = obs.keys[:, :, s:e]
        yield s, keys.float() if obs.rope is None else obs.rope.unrotate(keys, s, e)


def leverage(obs, dimension: int, seed: int) -> "torch.Tensor":
    """``x_n^T (X^T X + JITTER I)^{-1} x_n`` [b, Hkv, L] float32 of the centred, sketched keys
    (0 on padding)."""
    b, hkv, n, d = obs.keys.shape
    valid = obs.entry_valid.expand(b, hkv, n)[..., None].float()  # [b, Hkv, L, 1]
    phi = sketch(d, dimension, seed, obs.layer, obs.keys.device)  # [d, k]
    total = sum((k * valid[:, :, s : s + k.shape[2]]).sum(2) for s, k in prerope_blocks(obs))
    mean = total / valid.sum(2).clamp_min(1.0)  # [b, Hkv, d]
    gram = 0
    for s, k in prerope_blocks(obs):
        x = ((k - mean[:, :, None]) @ phi).mul_(valid[:, :, s : s + k.shape[2]])
        x = x.double()  # in float32 a low-rank Gram matrix may lose its definiteness to rounding
        gram = gram + x.transpose(-1, -2) @ x
    eye = torch.eye(dimension, device=obs.keys.device, dtype=torch.float64)
    symmetric = (gram + gram.transpose(-1, -2)) / 2
    factor = torch.linalg.cholesky_ex(symmetric + JITTER * eye).L  # [b, Hkv, k, k], no host sync
    inverse = torch.linalg.solve_triangular(factor, eye.expand_as(factor), upper=False)  # L^{-1}
    inverse = inverse.float()
    out = torch.empty(b, hkv, n, device=obs.keys.device)
    for s, k in prerope_blocks(obs):
        x = ((k - mean[:, :, None]) @ phi).mul_(valid[:, :, s : s + k.shape[2]])
        out[..., s : s + k.shape[2]] = (x @ inverse.transpose(-1, -2)).square_().sum(-1)
    return out


def zscore(s: "torch.Tensor", valid: "torch.Tensor") -> "torch.Tensor":
    """``(s - mean) / std`` over each sample's valid entries (unbiased std, at least 1e-6):
    s, valid [b, H, L]."""
    count = valid.sum((1, 2), keepdim=True)
    mean = (s * valid).sum((1, 2), keepdim=True) / count.clamp_min(1)
    var = ((s - mean).square() * valid).sum((1, 2), keepdim=True) / (count - 1).clamp_min(1)
    return (s - mean) / var.sqrt().clamp_min(1e-6)


def score(obs, cfg):
    """The z-scored leverage of the keys before RoPE -> [b, Hkv, P]."""
    b, hkv, n, _ = obs.keys.shape
    s = leverage(obs, cfg.sketch_dimension, cfg.sketch_seed)
    return zscore(s, obs.entry_valid.expand(b, hkv, n))[..., : obs.prefix_len]
