"""A composed selection (``compose``, ``restkv.strategies.compose``)."""

from __future__ import annotations

import functools
from dataclasses import replace

from ..cache import Kept
from ..config import CompressionConfig
from ..scoring.observe import Observation
from .decode import Policy, reselect
from .select import select


@functools.lru_cache(maxsize=256)
def first_stage(method: str, window: int, budget: int) -> CompressionConfig:
    """The first method's config: its registered defaults, a uniform top-``budget`` per KV head."""
    return CompressionConfig(
        method=method,
        window_size=window,
        max_capacity_prompt=budget,
        layer_budget="uniform",
        head_budget="uniform",
    )


def composed(plan, module, obs: Observation, kwargs) -> Kept:
    """The entries the config's method keeps [b, Hkv, B] among those ``compose``'s method keeps of
    the observation's L (``max(B, int(L (1 - compose_ratio)))`` per head, window included)."""
    cfg = plan.cfg
    n = obs.keys.shape[2]
    pruned = max(obs.budget, int(n * (1 - cfg.compose_ratio)))
    if pruned >= n:
        return select(obs, cfg, plan.table)
    first = select(replace(obs, budget=pruned), first_stage(cfg.compose, obs.window, pruned))
    valid = first.valid[:, None].expand_as(first.positions)
    policy = Policy(plan, (), 0, None if obs.rope is None else obs.rope.embed)
    queries = obs.queries[:, :, -obs.window :]
    kept, _, _ = reselect(
        policy,
        module,
        queries,
        first.keys,
        first.values,
        valid,
        first.positions,
        first.positions,
        obs.budget,
        kwargs,
        None,
        pack=False,
    )
    return kept
