"""Eviction during decoding (``decode_interval``, declared in ``restkv.strategies.decoding``).

Every ``decode_interval`` new tokens, each evicted layer is scored again over what it holds, with the
``window_size`` most recent queries as the observation window, and shrunk back to the budget it had at
prefill (per layer, per sample; per head as its head budgets share it: AdaKV from the new scores, HeadKV
from its table), or with ``decode_compression_ratio`` r to ``int(n (1 - r))`` of the n tokens each
sample has seen. A head so never holds more than its budget plus ``decode_interval`` entries (a
forward of q > 1 tokens, e.g. a question after ``compress_context``, holds budget + q during that
forward).

The scorer sees the layer's entries in cache order: ``Observation.keys`` are the entries held,
``queries`` the window's only (``first_query = L - w``), positions the entries' order in the cache. When
heads hold different numbers of entries, each head is laid out as its older entries, a gap it does not
hold (``head_valid``), then its newest ``window_size`` entries: the window is the last w slots of every
head, as at prefill. A layer arms itself at prefill (``arm``) and carries its policy, its recent queries
and its count of new tokens, so any attachment that decodes it (sweep mode's too) keeps evicting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..cache import Kept, cache_layer, stack_samples
from ..scoring.precision import float32_scoring
from ..scoring.rope import Rope
from ..strategies.budgets import fits
from ..strategies import rerotate
from ..strategies.decoding import decoding_budgets
from .observation import observation
from .select import select


@dataclass(frozen=True)
class Policy:
    """How an armed layer evicts while decoding."""

    plan: object  # the layer's ``evict.LayerPlan``
    budgets: tuple  # this layer's budget per sample (window included), as at prefill
    interval: int
    embed: object = (
        None  # positions -> (cos, sin) of the layer's RoPE (``restkv.scoring.rope``), if it has one
    )


def arm(layer, plan, budgets, query, rope=None) -> None:
    """Make a cache layer evict while decoding: its policy, the prefill's last ``window_size`` queries
    ([b, Hq, w, d], copied) and no new tokens yet. ``rope``: the prefill's ``restkv.scoring.rope.Rope``."""
    cfg = plan.cfg
    layer.policy = Policy(
        plan, tuple(budgets), cfg.decode_interval, None if rope is None else rope.embed
    )
    layer.recent = query[:, :, -cfg.window_size :].clone()
    layer.since = 0
    if hasattr(layer, "reserve"):  # room for what is appended until the next eviction
        layer.reserve(cfg.decode_interval)


def decode_step(cache, module, query, kwargs) -> None:
    """After a forward's attention on an armed layer: remember its queries [b, Hq, q, d], and every
    ``decode_interval`` new tokens put the shrunk layer in its place in ``cache``."""
    layer = cache.layers[module.layer_idx]
    layer.recent = torch.cat([layer.recent, query], 2)[:, :, -layer.policy.plan.cfg.window_size :]
    layer.since += query.shape[2]
    if layer.since >= layer.policy.interval:
        cache.layers[module.layer_idx] = shrink(layer, module, kwargs)


def shrink(layer, module, kwargs):
    """The layer scored again over what it holds and cut back to its budget (a new cache layer, armed);
    the layer itself (with its count reset) when nothing exceeds the budget."""
    with torch.no_grad(), float32_scoring(layer.recent.device.type):
        return _shrink(layer, module, kwargs)


def _shrink(layer, module, kwargs):
    policy, (keys, values, valid, positions) = layer.policy, layer.stored_entries()
    budgets = _budgets(policy, positions)
    rotated = _rotated_at(policy, valid, positions)
    groups = (
        [slice(None)] if len(set(budgets)) == 1 else [slice(i, i + 1) for i in range(keys.shape[0])]
    )
    parts = [
        reselect(
            policy,
            module,
            layer.recent[g],
            keys[g],
            values[g],
            valid[g],
            positions[g],
            rotated[g],
            budgets[g.start or 0],
            kwargs,
            getattr(layer, "kv_heads", None),
        )
        for g in groups
    ]
    if all(evicted is False for _, evicted in parts):
        layer.since = 0
        return layer
    kept = parts[0][0] if len(parts) == 1 else stack_samples([p for p, _ in parts])
    new = cache_layer(kept, layer.seen, policy.plan.cfg)
    new.policy = policy
    new.recent = layer.recent
    new.since = 0
    if hasattr(new, "reserve"):
        new.reserve(policy.interval)
    return new


def _budgets(policy, positions) -> tuple:
    """Each sample's budget now: the prefill's, or a share of the tokens it has seen
    (``decode_compression_ratio``; one host read per eviction)."""
    cfg = policy.plan.cfg
    if cfg.get("decode_compression_ratio") is None:
        return policy.budgets
    seen = (positions.amax((1, 2)) + 1).tolist()
    return tuple(decoding_budgets(cfg, seen, policy.plan.num_evicted, policy.plan.rank))


def _rotated_at(policy, valid, positions):
    """[b, H, n] the positions at which the held keys are rotated: their own, or with
    ``rerotate_keys`` each head's entries packed before the newest token
    (``restkv.strategies.rerotate``)."""
    if not rerotate.applies(policy.plan.cfg):
        return positions
    rotated = rerotate.packed_positions(valid, positions.amax((1, 2)), "end")
    return rotated.masked_fill(~valid, -1)


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
    pack=True,
):
    """``(Kept, evicted)`` of one group of samples: its entries laid out for the scorer, then selected
    (``evicted`` False: all fit the budget and are kept as they are). ``rotated`` [b, H, n]: where
    the held keys are rotated (``_rotated_at``); ``pack``: re-rotate the kept keys (with
    ``rerotate_keys``).
    Also the second stage of a composed selection (``restkv.eviction.compose``, ``pack=False``)."""
    plan = policy.plan
    index, held, width, same = relayout(valid, plan.cfg.window_size)
    keys, values = (
        x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1])) for x in (keys, values)
    )
    positions = positions.gather(2, index).masked_fill(~held, -1)
    rotated = rotated.gather(2, index).masked_fill(~held, -1)
    key_valid = held[:, 0] if same else held.any(1)
    if fits(plan.cfg, width, budget):
        return Kept(
            keys,
            values,
            positions,
            key_valid if same else held,
            per_head=not same,
            kv_heads=kv_heads,
        ), False
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
    kept = select(obs, plan.cfg, plan.table)
    valid_kept = kept.valid if kept.valid.dim() == 3 else kept.valid[:, None]
    real = positions.gather(2, kept.index).masked_fill(~valid_kept, -1)
    kept = replace(kept, positions=real, kv_heads=kv_heads)
    if pack and rerotate.applies(plan.cfg):
        kept = _packed(policy, kept, rotated.gather(2, kept.index).clamp_min(0))
    return kept, True


def _packed(policy, kept, now):
    """``kept`` with its keys, rotated at ``now`` [b, H, K], moved to the positions before the
    newest."""
    valid = kept.valid if kept.valid.dim() == 3 else kept.valid[:, None]
    valid = valid.expand_as(kept.positions)
    target = rerotate.packed_positions(valid, kept.positions.amax((1, 2)), "end")
    keys = rerotate.rerotated(kept.keys, valid, now, target, policy.embed)
    return replace(kept, keys=keys)


def _rope(embed, positions):
    """The ``Rope`` of the scorer's layout: cos/sin at each slot's position [b, L] as the first head holds it
    (exact at the window's slots, the same for every head), the next position after the newest entry."""
    if embed is None:
        return None
    first = positions[:, 0].clamp_min(0)
    cos, sin = embed(first)
    return Rope(cos, sin, positions.amax((1, 2)) + 1, embed)


def relayout(valid, window: int):
    """Slots of the scorer's layout for entries with validity ``valid`` [b, H, n].

    Each head's entries keep their order; its newest ``window`` fill the last slots, its older ones start
    where the sample's longest head starts (so every sample is left padded, as a prompt is), and a shorter
    head leaves a gap between the two. Returns ``index`` [b, H, width] (the entry in each slot), ``held``
    [b, H, width] (the slot holds one), ``width`` (the longest head) and ``same`` (every head of a sample
    holds as many entries: no gaps), with one host read.
    """
    b, heads, n = valid.shape
    count = valid.sum(-1)  # [b, H]
    width, differ = torch.stack(
        [count.max(), (count.amin(1) != count.amax(1)).any().long()]
    ).tolist()
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
