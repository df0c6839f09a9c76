"""Random: every prefix entry scored uniformly at random (seeded), the floor any method must beat.

As kvpress's ``RandomPress``; here the draws are independent per layer and reproducible: they
depend only on ``random_seed`` and the layer (never on the global random state).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch

KNOBS = (
    Knob(
        "random_seed",
        0,
        "seed of the random scores (draws differ per layer)",
        rule=">= 0",
    ),
)


def score(obs, cfg):
    """Uniform scores -> [b, Hkv, P] (the same draws for a layer whatever the device)."""
    b, hkv = obs.keys.shape[:2]
    g = torch.Generator().manual_seed(cfg.random_seed * 1_000_003 + obs.layer)
    return torch.rand(b, hkv, obs.prefix_len, generator=g).to(obs.keys.device)
