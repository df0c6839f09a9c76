"""One group of samples selected again over the entries its layer holds: laid out for the scorer (each head's
newest ``window_size`` entries in the last slots, as at prefill; ``relayout``), scored and selected, the kept
keys re-rotated with ``rerotate_keys``. Eviction while decoding (``restkv.eviction.decode``) and the second
stage of a composed selection (``restkv.eviction.compose``) run it."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..cache import Kept
from ..scoring.rope import LazyRope, Rope
from ..strategies import rerotate
from ..strategies.budgets import fits
from .observation import observation
from .select import select


def reselect(
    policy,
    module,
    recent,
    keys,
    values,
    valid,
    positions,
    rotated,
    budget,
    kwargs,
    kv_heads,
    extent=None,
    pack=True,
):
    """``(Kept, slots, evicted)`` of one group of samples: its entries laid out for the scorer, then
    selected (``evicted`` False: all fit the budget and are kept as they are). ``slots``: the slots
    of every head that hold kept entries, an int or (per-head budgets) a device scalar; ``extent``
    the group's ``held_extent``, if known. ``rotated`` [b, H, n]: where the held keys are rotated
    (``decode._rotated_at``); ``pack``: re-rotate the kept keys (with ``rerotate_keys``).
    Also the second stage of a composed selection (``restkv.eviction.compose``, ``pack=False``)."""
    plan = policy.plan
    index, held, width, same = relayout(valid, plan.cfg.window_size, extent)
    keys, values = (
        x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1])) for x in (keys, values)
    )
    positions = positions.gather(2, index).masked_fill(~held, -1)
    rotated = rotated.gather(2, index).masked_fill(~held, -1)
    key_valid = held[:, 0] if same else held.any(1)
    if fits(plan.cfg, width, budget):
        kept = Kept(
            keys,
            values,
            positions,
            key_valid if same else held,
            per_head=not same,
            kv_heads=kv_heads,
        )
        return kept, width, False
    obs = observation(
        plan,
        module,
        recent,
        keys,
        values,
        key_valid,
        budget,
        kwargs,
        {},
        _rope(policy.embed, rotated),
        None if same else held,
    )
    kept = select(obs, plan.cfg, plan.table, width=width)
    valid_kept = kept.valid if kept.valid.dim() == 3 else kept.valid[:, None]
    real = positions.gather(2, kept.index).masked_fill(~valid_kept, -1)
    kept = replace(kept, positions=real, kv_heads=kv_heads)
    if pack and rerotate.applies(plan.cfg):
        kept = _packed(policy, kept, rotated.gather(2, kept.index).clamp_min(0))
    return kept, _used_slots(kept), True


def _used_slots(kept: Kept):
    """The slots up to every head's last kept entry: the width with a budget shared by the heads,
    else a device scalar (per-head budgets laid out on the scorer's width)."""
    if not kept.per_head:
        return kept.keys.shape[-2]
    slot = torch.arange(1, kept.valid.shape[-1] + 1, device=kept.valid.device)
    return (kept.valid * slot).amax()


def _packed(policy, kept, now):
    """``kept`` with its keys, rotated at ``now`` [b, H, K], moved to the positions before the
    newest."""
    valid = kept.valid if kept.valid.dim() == 3 else kept.valid[:, None]
    valid = valid.expand_as(kept.positions)
    target = rerotate.packed_positions(valid, kept.positions.amax((1, 2)), "end")
    keys = rerotate.rerotated(kept.keys, valid, now, target, policy.embed)
    return replace(kept, keys=keys)


def _rope(embed, positions):
    """The ``Rope`` of the scorer's layout: cos/sin at each slot's position [b, L] as the first head
    holds it (exact at the window's slots, the same for every head), the next position after the
    newest entry; computed only if the scorer reads it (``LazyRope``)."""
    if embed is None:
        return None

    def make():
        cos, sin = embed(positions[:, 0].clamp_min(0))
        return Rope(cos, sin, positions.amax((1, 2)) + 1, embed)

    return LazyRope(make, embed)


def relayout(valid, window: int, extent: tuple[int, bool] | None = None):
    """Slots of the scorer's layout for entries with validity ``valid`` [b, H, n].

    Each head's entries keep their order; its newest ``window`` fill the last slots, its older ones
    start where the sample's longest head starts (so every sample is left padded, as a prompt is),
    and a shorter head leaves a gap between the two. Returns ``index`` [b, H, width] (the entry in
    each slot), ``held`` [b, H, width] (the slot holds one), ``width`` (the longest head) and
    ``same`` (every head of a sample holds as many entries: no gaps); ``extent`` ``(width, same)``
    when the cache layer knows them, else one host read.
    """
    b, heads, n = valid.shape
    count = valid.sum(-1)  # [b, H]
    if extent is None:
        width, differ = torch.stack(
            [count.max(), (count.amin(1) != count.amax(1)).any().long()]
        ).tolist()
    else:
        width, differ = extent[0], not extent[1]
    longest = count.amax(1, keepdim=True)[..., None]
    rank = valid.long().cumsum(-1) - 1
    slot = torch.where(
        rank < (count - window)[..., None], width - longest + rank, width - count[..., None] + rank
    )
    slot = slot.masked_fill(~valid, width)  # entries not held go to a slot that is dropped
    entries = torch.arange(n, device=valid.device).expand(b, heads, n)
    index = torch.zeros(b, heads, width + 1, dtype=torch.long, device=valid.device).scatter_(
        2, slot, entries
    )
    held = torch.zeros(b, heads, width + 1, dtype=torch.bool, device=valid.device).scatter_(
        2, slot, valid
    )
    return index[..., :width], held[..., :width], width, not differ
