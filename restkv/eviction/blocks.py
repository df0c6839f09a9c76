"""A selection block by block (``prompt_block``, ``restkv.strategies.blocks``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..cache import Kept
from ..scoring.observe import Observation
from ..strategies.blocks import steps
from .decode import Policy, reselect
from .select import select


def blockwise(plan, module, obs: Observation, kwargs) -> Kept:
    """The entries [b, Hkv, B] kept when the observation's L entries arrive in blocks: the first B
    kept, then at each block the config's selection over the kept entries and the block, observed by
    the block's last ``window_size`` queries. Positions from each sample's first real token, as
    ``select``'s."""
    cfg = plan.cfg
    b, heads, n, _ = obs.keys.shape
    budget = obs.budget
    blocks = steps(n, budget, cfg.prompt_block, obs.window)
    if not blocks:
        return select(obs, cfg, plan.table)
    policy = Policy(plan, (), 0, None if obs.rope is None else obs.rope.embed)
    index = torch.arange(budget, device=obs.keys.device).expand(b, heads, budget)
    held = obs.key_valid[:, None, :budget].expand(b, heads, budget)
    relative = obs.positions[:, None].expand(b, heads, n)
    for start, stop in blocks:
        block = torch.arange(start, stop, device=obs.keys.device).expand(b, heads, -1)
        current = torch.cat([index, block], -1)
        valid = torch.cat([held, obs.key_valid[:, None, start:stop].expand_as(block)], -1)
        kept, _, _ = reselect(
            policy,
            module,
            obs.queries[:, :, stop - obs.window : stop],
            _gather(obs.keys, current),
            _gather(obs.values, current),
            valid,
            current,
            relative.gather(2, current),
            budget,
            kwargs,
            None,
            pack=False,
        )
        held = kept.valid if kept.valid.dim() == 3 else kept.valid[:, None]
        held = held.expand_as(kept.positions)
        index = kept.positions.clamp_min(0)
    positions = relative.gather(2, index).masked_fill(~held, -1)
    return replace(kept, positions=positions, index=index)


def _gather(x, index):
    """Entries ``index`` [b, H, K] of x [b, H, L, d] -> [b, H, K, d]."""
    return x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1]))
