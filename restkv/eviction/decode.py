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
layers in place. The selection over the held entries is ``restkv.eviction.reselect``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import HeldSizes, cache_layer, newest_positions, stack_samples
from ..scoring.precision import float32_scoring
from ..strategies import rerotate
from ..strategies.decoding import decoding_budgets
from .reselect import relayout, reselect  # noqa: F401  (read from here too)


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
