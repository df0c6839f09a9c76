"""Selections that need every layer's prefill first: one top-k over all layers, passes after the prefill.

A deferred plan (``LayerPlan.deferred``: ``layer_budget="global"``, or a method with ``passes`` such as
KVzip) keeps each layer's full cache during the prefill; the layer leaves a ``LayerPrefill`` (its
selection scores, or none when they come from passes; its queries released). Once the model's prefill
forward has returned, ``finish``

1. runs the method's passes, if it has any, and scores every such layer from them (one set of passes
   per prompt, shared by every config with the same score knobs in sweep mode);
2. shares the budget: one top-k over every layer's and head's scores (``budgets.shared_sizes``, the
   vLLM plugin's too), or the per-layer strategies as at once;
3. selects each layer's kept entries; the caller puts the cache layers in place.

The attachment calls it from a forward hook on the decoder (``decoder_of``): in ``generate()`` that is
before the first new token is chosen, and a plain ``model(...)`` returns the finished cache. Sweep mode
calls it after its one prefill.
"""

from __future__ import annotations

import copy
import functools
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from ..scoring.observe import Observation
from ..scoring.precision import float32_scoring
from ..strategies.budgets import shared_sizes
from .observation import layer_wo_factor
from ..compat import cache_argument
from .step import LayerPrefill


def decoder_of(model: nn.Module) -> nn.Module:
    """The module that runs the decoder layers (``model.model`` of a causal LM); the model itself if none."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and any(
            hasattr(x, "o_proj") for x in layers.modules()
        ):
            return m
    return model


@torch.no_grad()
def finish(
    model, cache, prefills: list[LayerPrefill], input_ids, shared: dict | None = None
) -> list:
    """Finish one config's deferred layers of a prefill -> ``[(prefill, cache layer or None, positions)]``.

    ``cache`` the prefill's (full) cache, ``input_ids`` [b, n] its prompt, ``shared`` the passes' scores of
    the other configs finished on this prompt.
    """
    cfg = prefills[0].plan.cfg
    if cfg.scorer.replays:
        key = (cfg.scorer.scorer, cfg.score_knobs(), tuple(p.module.layer_idx for p in prefills))
        shared = {} if shared is None else shared
        if key not in shared:
            shared[key] = replay_scores(model, cache, prefills, input_ids)
    with float32_scoring(prefills[0].key.device.type):
        for p in prefills if cfg.scorer.replays else ():
            p.score(shared[key][p.module.layer_idx])
        return _select(cfg, prefills)


def _select(cfg, prefills: list[LayerPrefill]) -> list:
    """Each deferred layer's selection, its budget shared across layers when ``layer_budget="global"``."""
    sizes = [None] * len(prefills)
    if (
        cfg.get("layer_budget") == "global"
    ):  # every evicted layer is deferred: len(prefills) layers share it
        parts = [  # a part that keeps all it holds has no scores (the same in every layer)
            None if fit else shared_sizes(cfg, [p.scores[i] for p in prefills], budget)
            for i, ((_, _, budget), fit) in enumerate(zip(prefills[0].parts, prefills[0].fit))
        ]
        sizes = [
            [None if part is None else part[layer] for part in parts]
            for layer in range(len(prefills))
        ]
    return [(p, *p.result(p.select(s))) for p, s in zip(prefills, sizes)]


def replay_scores(model, cache, prefills: list[LayerPrefill], input_ids) -> dict:
    """The method's scores of every prompt position from its passes: {layer_idx: [b, H, n] float32}
    (a sample without a pass, all of it sinks, scores 0; H = 1 when no sample had one).

    Each sample (its real tokens only, batch 1 as the reference) runs every pass on a shallow copy of
    the cache whose layers never store into the prompt's entries (``_pass_layer``), so no pass's
    tokens stay in it and no second copy of the cache is held: at each scored layer the pass's
    queries observe [sinks | the pass's positions | the pass's own keys]. A method with
    ``run_pass(decoder, ids, position_ids, cache, modules)`` runs each pass itself and returns a
    weight per pass token [1, r] for each attention module (``Observation.query_weights``); its
    layers are scored after the pass.

    A method with ``PASS_CHUNK`` (KVCompose) reads each pass in forwards of that many tokens, so
    that no forward builds a [pass, L + pass] mask: the views keep the pass's own keys and values
    apart between its forwards (one more copy of the model's K+V at most, as the reference's cache
    of 2L). Each forward's queries give ``query_statistic(obs, cfg)`` [1, Hq, n]; ``merge(a, b,
    cfg)`` combines the forwards' statistics, and ``finish(statistic, rows, Hkv, cfg)`` turns the
    pass's into its scores.
    """
    if input_ids is None:
        raise ValueError(
            f"method {prefills[0].plan.cfg.method} reads the prompt's token ids: call the model "
            "with input_ids (not inputs_embeds)"
        )
    cfg = prefills[0].plan.cfg
    knobs = cfg.score_knobs()
    decoder = decoder_of(model)
    lengths = prefills[0].key_valid.sum(-1).tolist()
    b, n = input_ids.shape
    out: dict = {}
    for s, length in enumerate(lengths):
        pad = n - length
        sinks, passes = cfg.scorer.module.passes(input_ids[s, pad:], knobs, model)
        base = [_sample_view(layer, s, length) for layer in cache.layers]
        for start, stop, ids in passes:
            span = (sinks, start, stop)
            scores = _pass_scores(decoder, base, cache, prefills, ids, length, span)
            for idx, r in scores.items():
                if idx not in out:
                    out[idx] = r.new_zeros(b, r.shape[1], n)
                row = out[idx][s]
                row[:, pad : pad + sinks] = r[0, :, :sinks]
                row[:, pad + start : pad + stop] = r[0, :, sinks : sinks + stop - start]
    for p in prefills:  # no sample had a pass (each within its sinks): every entry ties
        out.setdefault(p.module.layer_idx, p.key.new_zeros(b, 1, n, dtype=torch.float32))
    return out


def _pass_scores(decoder, base, cache, prefills, ids, length, span) -> dict:
    """One pass ``ids`` [r] after the sample's ``length`` held tokens (``base``: its cache layers) ->
    {layer_idx: [1, H, sinks + stop - start] float32}, the scores of [sinks | the pass's positions]
    (``span`` = (sinks, start, stop))."""
    sinks, start, stop = span
    cfg = prefills[0].plan.cfg
    knobs = cfg.score_knobs()
    module = cfg.scorer.module
    # a pass that is more than a forward (KVgrad's backward)
    run = getattr(module, "run_pass", None)
    chunked = hasattr(module, "PASS_CHUNK")
    chunk = getattr(module, "PASS_CHUNK", None) or ids.shape[0]
    statistic = module.query_statistic if chunked else cfg.scorer.score
    observed = []
    out: dict = {}

    def observe(prefill, query, key, value):
        def part(x):  # [sinks | the pass's positions | the pass's own entries]
            return torch.cat([x[:, :, :sinks], x[:, :, start:stop], x[:, :, length:]], 2).detach()

        keys = part(key)
        obs = Observation(
            queries=query.detach(),
            keys=keys,
            values=part(value),
            window=query.shape[2],
            budget=keys.shape[2],
            scaling=prefill.scaling,
            softcap=prefill.softcap,
            key_valid=torch.ones(1, keys.shape[2], dtype=torch.bool, device=keys.device),
            wo_factor=lambda m=prefill.module, at=keys.device: layer_wo_factor(m, at),
            layer=prefill.plan.rank,
            num_layers=prefill.plan.num_evicted,
        )
        observed.append((prefill, obs))
        if run is None:  # scored at once; after the pass when it weighs its tokens (query_weights)
            record(*observed.pop())

    def record(prefill, obs):
        with float32_scoring(obs.keys.device.type):
            r = statistic(obs, knobs)[..., : sinks + stop - start]  # not the pass's own entries
        idx = prefill.module.layer_idx
        out[idx] = r if idx not in out else module.merge(out[idx], r, knobs)

    view = copy.copy(cache)
    view.layers = [_pass_layer(layer, keep=chunk < ids.shape[0]) for layer in base]
    with _scoring(prefills, observe):
        for first in range(0, ids.shape[0], chunk):
            part_ids = ids[first : first + chunk]
            at = length + first
            position_ids = torch.arange(at, at + part_ids.shape[0], device=ids.device)[None]
            if run is None:
                decoder(
                    input_ids=part_ids[None],
                    position_ids=position_ids,
                    use_cache=True,
                    **{cache_argument(decoder): view},
                )
            else:
                modules = [p.module for p in prefills]
                weights = run(decoder, part_ids[None], position_ids, view, modules)
            for prefill, obs in observed:
                obs.query_weights = weights[prefill.module]
                record(prefill, obs)
            observed.clear()
    if not chunked:
        return out
    hkv = prefills[0].key.shape[1]
    return {idx: module.finish(r, ids.shape[0], hkv, knobs) for idx, r in out.items()}


def _pass_layer(layer, keep: bool = False):
    """A shallow copy of a cache layer for one pass: a full layer returns its entries and the pass's
    without storing them in its own, so that the pass holds no second copy of the prompt's entries;
    the copy of a layer is made there, one layer at a time, and freed after its attention. ``keep``:
    the pass comes in several forwards, and the view keeps the pass's own entries apart between
    them."""
    view = copy.copy(layer)
    if type(layer) is DynamicLayer:
        view.pass_entries = None
        view.keep_pass = keep
        view.update = functools.partial(_attend_without_storing, view)
        view.get_seq_length = functools.partial(_held_and_pass, view)
    return view


def _attend_without_storing(view, key_states, value_states, *args, **kwargs):
    """``DynamicLayer.update`` of a pass's view: [held | the pass's earlier entries | new] keys and
    values, the held ones left as they were."""
    if view.pass_entries is not None:
        key_states = torch.cat([view.pass_entries[0], key_states], -2)
        value_states = torch.cat([view.pass_entries[1], value_states], -2)
    if view.keep_pass:
        view.pass_entries = (key_states, value_states)
    return torch.cat([view.keys, key_states], -2), torch.cat([view.values, value_states], -2)


def _held_and_pass(view) -> int:
    """``get_seq_length`` of a pass's view: the held entries and the pass's kept ones."""
    own = 0 if view.pass_entries is None else view.pass_entries[0].shape[-2]
    return view.keys.shape[-2] + own


def _sample_view(layer, sample: int, length: int):
    """A shallow copy of a full (or sliding-window) cache layer holding sample ``sample``'s real tokens only."""
    view = copy.copy(layer)
    held = layer.keys.shape[2]
    drop = held - min(held, length)  # left padding
    view.keys, view.values = (
        layer.keys[sample : sample + 1, :, drop:],
        layer.values[sample : sample + 1, :, drop:],
    )
    if hasattr(layer, "cumulative_length"):
        view.cumulative_length = length
    return view


@contextmanager
def _scoring(prefills, score):
    """Each prefill's attention module calls ``score(prefill, query, key, value)`` after its attention, in the
    block."""
    for p in prefills:
        p.module._restkv.replay = lambda query, key, value, p=p: score(p, query, key, value)
    try:
        yield
    finally:
        for p in prefills:
            p.module._restkv.replay = None
