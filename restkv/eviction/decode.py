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

Host reads: none per decoded token, and one per interval for the whole model (two after beam search
reordered the samples: the layers' sizes first, ``_measure_unknown``). Each layer selects on
the device (``decode_step``, a ``Shrink``): its layout's width is known from the sizes its cache
layer read when it was built (``HeldSizes``), per-head budgets are laid out on that width; after the
decoder's forward ``finish`` reads every layer's sizes at once, cuts the parts and puts the shrunk
layers in place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..cache import HeldSizes, Kept, cache_layer, newest_positions, stack_samples
from ..scoring.precision import float32_scoring
from ..scoring.rope import LazyRope, Rope
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


@dataclass
class Shrink:
    """A layer's selection at an interval, computed on the device and waiting for its sizes:
    ``finish`` puts the shrunk layer in place, with one host read for every layer of the forward."""

    cache: object
    layer_idx: int
    layer: object  # the cache layer it replaces, as it was when selected
    seen: int
    parts: list  # a ``Kept`` per group of samples, maybe with slots past every head's entries
    widths: list  # the slots each part keeps: an int, or a device scalar (read in ``finish``)


def decode_step(cache, module, query, kwargs) -> Shrink | None:
    """After a forward's attention on an armed layer: remember its queries [b, Hq, q, d], and every
    ``decode_interval`` new tokens select again (a ``Shrink`` for ``finish``; None when nothing is
    due or every head fits its budget)."""
    layer = cache.layers[module.layer_idx]
    layer.recent = torch.cat([layer.recent, query], 2)[:, :, -layer.policy.plan.cfg.window_size :]
    layer.since += query.shape[2]
    if layer.since < layer.policy.interval:
        return None
    return shrink(cache, module, kwargs)


def shrink(cache, module, kwargs) -> Shrink | None:
    """The selection of ``module``'s cache layer over what it holds, cut back to its budget,
    computed without a host read (a ``Shrink``); None, the layer's count reset, when nothing exceeds
    the budget."""
    layer = cache.layers[module.layer_idx]
    if layer.held_extent() is None:  # samples reordered (beam search) since the layer was built
        _measure_unknown(cache)
    with torch.no_grad(), float32_scoring(layer.recent.device.type):
        parts = _shrink(layer, module, kwargs)
    if all(evicted is False for _, _, evicted in parts):
        layer.since = 0
        return None
    return Shrink(
        cache,
        module.layer_idx,
        layer,
        layer.seen,
        [kept for kept, _, _ in parts],
        [width for _, width, _ in parts],
    )


def _measure_unknown(cache) -> None:
    """The ``HeldSizes`` of every armed layer of ``cache`` that lost them (a reorder of its
    samples), with one host read for all."""
    layers = [
        layer
        for layer in cache.layers
        if getattr(layer, "policy", None) is not None and layer.held_extent() is None
    ]
    measured = [layer.measured_sizes() for layer in layers]
    device = measured[0].device
    values = torch.cat([m.to(device) for m in measured]).tolist()  # one host read
    start = 0
    for layer, m in zip(layers, measured):
        layer.sizes = HeldSizes.read(values[start : start + m.numel()])
        start += m.numel()


def _shrink(layer, module, kwargs) -> list:
    """``(Kept, slots, evicted)`` of each group of samples (one group when they share a budget)."""
    policy, (keys, values, valid, positions) = layer.policy, layer.stored_entries()
    budgets = _budgets(policy, layer)
    rotated = _rotated_at(policy, valid, positions)
    groups = (
        [slice(None)] if len(set(budgets)) == 1 else [slice(i, i + 1) for i in range(keys.shape[0])]
    )
    return [
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
            layer.held_extent(g),
        )
        for g in groups
    ]


def finish(shrinks: list) -> None:
    """Put the shrunk layers of ``shrinks`` (and empty it) in their caches, with one host read for
    all: the slots each part keeps and the new layers' ``HeldSizes``. A shrink whose layer has
    changed since (a forward that did not return) is dropped."""
    todo = [s for s in shrinks if s.cache.layers[s.layer_idx] is s.layer and s.layer.seen == s.seen]
    del shrinks[:]
    if not todo:
        return
    measured = [_measure(s) for s in todo]
    device = measured[0].device
    values = torch.cat([m.to(device) for m in measured]).tolist()  # the one host read
    start = 0
    for s, m in zip(todo, measured):
        s.cache.layers[s.layer_idx] = _shrunk(s, values[start : start + m.numel()])
        start += m.numel()


def _measure(s: Shrink) -> torch.Tensor:
    """[parts + 2 + 2 b] long: the slots each part keeps, then the ``HeldSizes`` of the new
    layer."""
    device = s.parts[0].valid.device
    heads = s.parts[0].keys.shape[1]
    widths = torch.stack([torch.as_tensor(w, device=device) for w in s.widths])
    count = torch.cat([_count(p.valid, heads) for p in s.parts])
    width = widths.amax() if len(s.parts) > 1 else widths[0]
    newest = torch.cat([newest_positions(p.positions) for p in s.parts])
    return torch.cat([widths, HeldSizes.measure(count, width, newest)])


def _count(valid, heads: int) -> torch.Tensor:
    """[b, heads] entries each head keeps, from ``valid`` [b, B] or [b, H, B]."""
    count = valid.sum(-1)
    return count if count.dim() == 2 else count[:, None].expand(-1, heads)


def _shrunk(s: Shrink, values: list):
    """The new cache layer of a shrink, armed as its layer was, from its read ``values``."""
    k = len(s.parts)
    parts = [p.narrowed(w) for p, w in zip(s.parts, values[:k])]
    kept = parts[0] if k == 1 else stack_samples(parts)
    policy = s.layer.policy
    new = cache_layer(kept, s.layer.seen, policy.plan.cfg, sizes=HeldSizes.read(values[k:]))
    new.policy = policy
    new.recent = s.layer.recent
    new.since = 0
    if hasattr(new, "reserve"):
        new.reserve(policy.interval)
    return new


def _budgets(policy, layer) -> tuple:
    """Each sample's budget now: the prefill's, or a share of the tokens it has seen
    (``decode_compression_ratio``; known on the host from the layer's ``HeldSizes``)."""
    cfg = policy.plan.cfg
    if cfg.get("decode_compression_ratio") is None:
        return policy.budgets
    seen = list(layer.seen_per_sample())
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
    extent=None,
    pack=True,
):
    """``(Kept, slots, evicted)`` of one group of samples: its entries laid out for the scorer, then
    selected (``evicted`` False: all fit the budget and are kept as they are). ``slots``: the slots
    of every head that hold kept entries, an int or (per-head budgets) a device scalar; ``extent``
    the group's ``held_extent``, if known. ``rotated`` [b, H, n]: where the held keys are rotated
    (``_rotated_at``); ``pack``: re-rotate the kept keys (with ``rerotate_keys``).
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
