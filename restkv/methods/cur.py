"""CUR (CurDKV): keep the entries of largest approximate key and value leverage.

Paper: "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition" (Sengupta et al.,
2025), https://arxiv.org/abs/2509.15038; code: kvpress ``CURPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/cur_press.py``), whose definition this is.

Per KV head, an entry's key leverage is ``||k_n||^2`` and its value leverage ``||v_n||^2``
(``use_random_leverage``: of ``k G`` and ``v G``, ``G`` a Gaussian d x 20 sketch scaled by
1/sqrt(20)); with ``use_local_approximation`` each is divided by its total over the entry's chunk of
``local_window_size`` consecutive tokens. ``leverage_type`` combines them (``key``, ``value``, their
mean ``kv_avg`` or their product ``kv_product``), the result is divided by its total over the head's
entries, and the first ``sink_tokens`` tokens (the reference's ``num_sinks``) score 1 (above every
other entry). Query-free.

Differences: chunks and sinks count from each sample's first real token (the reference counts from
the tensor's first index, the same without padding), padding takes no part in the totals; the sketch
is seeded (``sketch_seed``, per layer: the reference draws from the global random state at every
call); the observation window is always kept (the reference keeps none; ``window_size=1`` comes
closest)."""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch
from . import streamingllm
from .partition import chunk_sums

SKETCH = 20  # columns of the random sketch (the reference's r)
SKETCH_SEED = Knob(
    "sketch_seed",
    0,
    "seed of the Gaussian sketch (draws differ per layer)",
    rule=">= 0",
)

KNOBS = (
    streamingllm.KNOBS[0],
    Knob(
        "leverage_type",
        "kv_product",
        "how key and value leverage combine",
        choices=("key", "value", "kv_avg", "kv_product"),
    ),
    Knob(
        "use_random_leverage",
        False,
        "leverage of the keys and values after a Gaussian sketch to 20 columns",
    ),
    SKETCH_SEED.but(when={"use_random_leverage": (True,)}),
    Knob(
        "use_local_approximation",
        True,
        "normalise the leverage over chunks of local_window_size tokens",
    ),
    Knob(
        "local_window_size",
        16,
        "tokens per chunk of the local normalisation",
        rule=">= 1",
        when={"use_local_approximation": (True,)},
    ),
)


def sketch(d: int, r: int, seed: int, layer: int, device) -> "torch.Tensor":
    """The Gaussian sketch [d, r] scaled by 1/sqrt(r) of a layer (the same draws on any device)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    return (torch.randn(d, r, generator=g) / r**0.5).to(device)


def squared_norms(x: "torch.Tensor", G) -> "torch.Tensor":
    """``||x_n||^2`` (or ``||x_n G||^2``) [b, H, L] float32 of x [b, H, L, d]."""
    if G is None:
        return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).square_()
    return (x.float() @ G).square_().sum(-1)


def score(obs, cfg):
    """The combined leverage, normalised, sinks at 1 -> [b, Hkv, P]."""
    G = None
    if cfg.use_random_leverage:
        G = sketch(obs.keys.shape[-1], SKETCH, cfg.sketch_seed, obs.layer, obs.keys.device)
    valid = obs.entry_valid  # [b, 1 or Hkv, L]
    parts = {}
    for name, x in (("key", obs.keys), ("value", obs.values)):
        if cfg.leverage_type in (name, "kv_avg", "kv_product"):
            s = squared_norms(x, G).mul_(valid)
            if cfg.use_local_approximation:
                s = s.div_(chunk_sums(s, obs.key_valid, cfg.local_window_size).clamp_min_(1e-30))
            parts[name] = s
    if cfg.leverage_type == "kv_product":
        s = parts["key"] * parts["value"]
    elif cfg.leverage_type == "kv_avg":
        s = (parts["key"] + parts["value"]) / 2
    else:
        s = parts[cfg.leverage_type]
    s = s.div_(s.sum(-1, keepdim=True).clamp_min_(1e-30))[..., : obs.prefix_len]
    pos = obs.positions[:, None, : obs.prefix_len]
    return torch.where((pos >= 0) & (pos < cfg.sink_tokens), 1.0, s)
