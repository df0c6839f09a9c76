"""Sweep mode: one prefill, many eviction configs.

Prefill attention always runs on the full cache, so a prompt's hidden states (and the queries, keys
and values every layer scores) do not depend on the eviction config. ``sweep`` prefills once; at each
evicted layer it runs the eviction step of every config on that layer's tensors and sets the result
aside. Each config then decodes greedily on its own cache: its compressed layers plus shallow copies
of the shared full ones (sliding-window layers, and layers a config leaves whole).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..cache import CompressedLayer, Kept, KeptLayer, VarlenLayer
from ..config import CompressionConfig
from ..eviction.deferred import finish
from ..eviction.plans import attention_modules
from ..eviction.step import evict_layer
from .attachment import attached
from .generation import ABSENT, eos_and_pad, forward, full_plans, greedy_decode, positions_and_mask
from .calibration import layer_plans


def _batch_key(cache):
    """Which layers a config compressed, when its cache can join a batched decode (else None).

    Configs with the same key decode together: their compressed layers are dense ``CompressedLayer``s
    and every other layer is a shallow copy of the shared full cache.
    """
    key = tuple(type(layer) is CompressedLayer for layer in cache.layers)
    shared = all(
        is_dense or not isinstance(layer, (KeptLayer, VarlenLayer))
        for is_dense, layer in zip(key, cache.layers)
    )
    shared = shared and not any(
        getattr(layer, "policy", None) for layer in cache.layers
    )  # evicts while decoding
    return key if shared and any(key) else None


def _stack_layers(layers, room: int):
    """One ``CompressedLayer`` holding several configs' layers along the batch (shorter ones padded, masked),
    with ``room`` for decoded tokens."""
    if not isinstance(
        layers[0], CompressedLayer
    ):  # a layer every config shares (e.g. sliding-window)
        merged = copy.copy(layers[0])
        merged.keys = torch.cat([layer.keys for layer in layers])
        merged.values = torch.cat([layer.values for layer in layers])
        return merged
    stored = max(layer.stored for layer in layers)
    per_head = any(layer.valid.dim() == 3 for layer in layers)

    def padded(t, fill):
        return F.pad(
            t,
            (0, 0, 0, stored - t.shape[-2]) if t.dim() == 4 else (0, stored - t.shape[-1]),
            value=fill,
        )

    def valid(layer):
        v = layer.key_valid()
        return v[:, None].expand(-1, layer.keys.shape[1], -1) if per_head and v.dim() == 2 else v

    kept = Kept(
        keys=torch.cat([padded(layer.keys, 0) for layer in layers]),
        values=torch.cat([padded(layer.values, 0) for layer in layers]),
        positions=torch.cat([padded(layer.positions, -1) for layer in layers]),
        valid=torch.cat([padded(valid(layer), False) for layer in layers]),
    )
    return CompressedLayer(kept, seen=layers[0].seen, room=room)


def _decode_together(model, caches, first, position_ids, mask, steps, eos, pad) -> list[Tensor]:
    """Greedy-decode several configs' caches as one batch; each result as its own run would give it."""
    b = first.shape[0]
    m = len(caches)
    merged = copy.copy(caches[0])
    merged.layers = [
        _stack_layers(list(layers), steps) for layers in zip(*(c.layers for c in caches))
    ]
    tokens, length = greedy_decode(
        model,
        merged,
        first.repeat(m),
        position_ids.repeat(m, 1),
        None if mask is None else mask.repeat(m, 1),
        steps,
        eos,
        pad,
        compact=True,
    )
    return [t[:, : int(n.max())] for t, n in zip(tokens.split(b), length.split(b))]


def release(layer) -> None:
    """Empty a full cache layer that no config reads any more (its entries freed once the layer's forward
    returns)."""
    b, h, _, d = layer.keys.shape
    layer.keys = layer.keys.new_empty(b, h, 0, d)
    layer.values = layer.values.new_empty(b, h, 0, layer.values.shape[-1])


@dataclass
class Prefill:
    """One prefill's result for several configs (``prefill_caches``)."""

    logits: Tensor  # [b, vocab] at the last prompt token (the same for every config)
    caches: (
        list  # one cache per config: its evicted layers plus shallow copies of the shared full ones
    )
    kept: list  # per config, per layer: the kept positions (as ``restkv.kept_positions``)
    position_ids: Tensor  # [b, n] the prompt's position ids
    mask: Tensor | None  # the attention mask the model saw (None: no padding)


def as_config(config) -> CompressionConfig:
    """A config given as keyword knobs (a dict) or already resolved (a ``CompressionConfig``)."""
    return (
        config if isinstance(config, CompressionConfig) else CompressionConfig.from_kwargs(**config)
    )


@torch.no_grad()
def prefill_caches(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, configs
) -> Prefill:
    """Prefill once and build every config's evicted cache (each config checked as ``configure`` checks it).

    At every layer the eviction step of each config runs on the same prefill tensors, with one memo
    per layer, so configs that read the same window attention or the same scores compute them once.
    Deferred configs (``restkv.eviction.deferred``) are finished after the prefill, configs with the same
    method and score knobs on one set of passes (KVzip's reconstruction runs once per prompt).
    Without deferred configs, a layer's full cache is released as soon as every config has its own layer,
    so the prefill holds the full entries of one layer at a time, as a single config's prefill does.
    """
    plans = [layer_plans(model, as_config(c)) for c in configs]
    modules = attention_modules(model)
    index = {m: i for i, m in enumerate(modules)}
    kept = [[None] * len(modules) for _ in plans]
    layers: list[dict] = [{} for _ in plans]
    deferred: list[list] = [[] for _ in plans]

    replays = any(
        p.deferred for plan in plans for p in plan
    )  # passes or a global budget read the full cache

    def evict_each(state, module, query, key, value, attention_mask, kwargs):
        i = index[module]
        memo = {}
        for c, plan in enumerate(plans):
            layer, kept[c][i] = evict_layer(
                plan[i],
                module,
                query,
                key,
                value,
                attention_mask,
                kwargs,
                memo,
                deferred[c],
                rope=state.rope,
                hidden=state.hidden,
            )
            if layer is not None:
                layers[c][module.layer_idx] = layer
        if not replays and all(module.layer_idx in own for own in layers):
            release(
                state.cache.layers[module.layer_idx]
            )  # every config holds its own: the full one goes

    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    position_ids, model_mask = positions_and_mask(mask)
    with attached(model, full_plans(model), on_prefill=evict_each):
        out = forward(model, input_ids, model_mask, position_ids)
        full = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        shared: dict = {}
        for c, prefills in enumerate(deferred):
            for prefill, layer, positions in (
                finish(model, full, prefills, input_ids, shared) if prefills else ()
            ):
                kept[c][index[prefill.module]] = positions
                if layer is not None:
                    layers[c][prefill.module.layer_idx] = layer
    caches = []
    for own in layers:
        cache = copy.copy(full)
        cache.layers = [own.get(j) or copy.copy(layer) for j, layer in enumerate(full.layers)]
        caches.append(cache)
    return Prefill(out.logits[:, -1], caches, kept, position_ids, model_mask)


@torch.no_grad()
def sweep(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    configs,
    max_new_tokens: int,
    eos_token_id=ABSENT,
    pad_token_id: int | None = None,
    batch_configs: bool = True,
) -> list[tuple[Tensor, list[Tensor | None]]]:
    """Evaluate several eviction configs on one prompt for the price of one prefill.

    Parameters
    ----------
    model : nn.Module
        A causal LM of a supported family and backend.
    input_ids, attention_mask : Tensor
        [b, n] prompt, left padded; ``attention_mask`` None means no padding.
    configs : iterable of dict or CompressionConfig
        Keyword knobs of ``restkv.configure`` / ``CompressionConfig.from_kwargs``, one dict per config, or
        configs already resolved.
    max_new_tokens : int
        Tokens to generate per config.
    eos_token_id, pad_token_id : optional
        As in ``generate``; by default the model's generation config. ``eos_token_id=None`` never stops.
    batch_configs : bool
        Decode the configs whose caches are dense ``CompressedLayer``s as one batch (rows padded to the
        longest cache and masked); the others, and all of them when False, decode one after another.

    Returns
    -------
    One ``(tokens, kept)`` per config, equal to what ``configure(model, **cfg)`` then
    ``model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=False)`` give:
    ``tokens`` [b, <= max_new_tokens] the generated ids (prompt excluded, ``pad_token_id`` after EOS),
    ``kept`` the per-layer list of ``restkv.kept_positions(model)``.

    The model's own configuration is restored afterwards.
    """
    eos, pad = eos_and_pad(model, eos_token_id, pad_token_id, input_ids.device)
    pre = prefill_caches(model, input_ids, attention_mask, configs)
    caches = pre.caches
    position_ids = pre.position_ids
    model_mask = pre.mask
    first = pre.logits.float().argmax(-1).to(input_ids.device)
    with attached(model, full_plans(model)):
        tokens: list[Tensor | None] = [None] * len(caches)
        groups: dict[tuple, list[int]] = {}
        for i, cache in enumerate(caches):
            key = _batch_key(cache) if batch_configs else None
            if key is not None:
                groups.setdefault(key, []).append(i)
        for together in (g for g in groups.values() if len(g) > 1):
            outs = _decode_together(
                model,
                [caches[i] for i in together],
                first,
                position_ids,
                model_mask,
                max_new_tokens,
                eos,
                pad,
            )
            for i, out in zip(together, outs):
                tokens[i] = out
                caches[i] = None
        for i in range(len(caches)):
            if tokens[i] is None:
                cache, caches[i] = caches[i], None
                tokens[i] = greedy_decode(
                    model, cache, first, position_ids, model_mask, max_new_tokens, eos, pad
                )[0]
        return list(zip(tokens, pre.kept))
