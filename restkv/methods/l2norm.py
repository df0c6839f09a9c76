"""L2Norm: keep the keys of smallest L2 norm.

Paper: "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(Devoto et al., 2024), https://arxiv.org/abs/2406.11430.
"""

from __future__ import annotations

KNOBS = ()


def score(obs, cfg):
    """Negative key norm -> [b, Hkv, P]."""
    return -obs.keys[:, :, : obs.prefix_len].float().norm(dim=-1)
