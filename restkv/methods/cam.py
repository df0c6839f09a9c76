"""CaM: evict by window attention, then merge each evicted value into the entries that follow it.

Paper: "CaM: Cache Merging for Memory-efficient LLMs Inference" (Zhang et al., ICML 2024),
https://proceedings.mlr.press/v235/zhang24n.html. Registered with ``merge="cam"`` (``restkv.strategies.merge``).
"""

from __future__ import annotations

from ..knobs import GQA_AGG

KNOBS = (GQA_AGG,)


def score(obs, cfg):
    """Window attention summed over the window queries, unpooled -> [b, Hq, P]."""
    return obs.window_attention[..., : obs.prefix_len].sum(-2)
