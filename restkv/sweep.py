"""Sweep mode: one prefill, many eviction configs.

Prefill attention always runs on the full cache, so a prompt's hidden states (and the queries, keys
and values every layer scores) do not depend on the eviction config. ``sweep`` prefills once; at each
evicted layer it runs the eviction step of every config on that layer's tensors and sets the result
aside. Each config then decodes greedily on its own cache: its compressed layers plus shallow copies
of the shared full ones (sliding-window layers, and layers a config leaves whole).
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import Tensor, nn

from .integration import _evict, attention_modules, configure

_ABSENT = object()


class _Sink:
    """Stands in for the model's cache in ``_evict``: receives the layer it would swap in."""

    def __init__(self):
        self.layers: dict[int, object] = {}


def _evict_each(plans, sinks, kept, index, module, plan, cache, query, key, value, attention_mask, kwargs):
    """The prefill hook: run the eviction step of every config (its own layer plan) on one layer."""
    i = index[module]
    for plans_cfg, sink, kept_cfg in zip(plans, sinks, kept):
        _evict(module, plans_cfg[i], sink, query, key, value, attention_mask, kwargs)
        kept_cfg[i] = module._restkv_kept


def _decode(model, cache, first: Tensor, position_ids: Tensor, mask: Tensor | None, steps: int,
            eos: Tensor | None, pad: int) -> Tensor:
    """Greedy decoding as ``generate(do_sample=False)`` does it, from the token chosen at prefill."""
    b = first.shape[0]
    tok, pos, out = first, position_ids[:, -1:], []
    unfinished = torch.ones(b, dtype=torch.bool, device=first.device)
    for step in range(steps):
        if step:
            pos = pos + 1
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(b, 1)], -1)
            logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                           use_cache=True, logits_to_keep=1).logits
            tok = logits[:, -1].float().argmax(-1).to(first.device)
        if eos is not None:
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
            unfinished &= ~torch.isin(tok, eos)
        out.append(tok)
        if eos is not None and not bool(unfinished.any()):
            break
    return torch.stack(out, 1)


def _eos_and_pad(model, eos_token_id, pad_token_id, device):
    gen = getattr(model, "generation_config", None)
    eos = eos_token_id if eos_token_id is not _ABSENT else getattr(gen, "eos_token_id", None)
    if eos is None:
        return None, 0
    eos = torch.as_tensor([eos] if isinstance(eos, int) else list(eos), device=device)
    pad = pad_token_id if pad_token_id is not None else getattr(gen, "pad_token_id", None)
    return eos, int(eos[0]) if pad is None else pad


def _save(model, modules):
    names = ("_restkv", "_restkv_kept")
    return getattr(model, "_restkv_config", _ABSENT), [[getattr(m, n, _ABSENT) for n in names] for m in modules]


def _restore(model, modules, saved):
    config, per_module = saved
    for obj, name, value in [(model, "_restkv_config", config)] + [
        (m, n, v) for m, vals in zip(modules, per_module) for n, v in zip(("_restkv", "_restkv_kept"), vals)
    ]:
        if value is _ABSENT:
            if hasattr(obj, name):
                delattr(obj, name)
        else:
            setattr(obj, name, value)
    for m in modules:
        m._restkv_evict = None


@torch.no_grad()
def prefill_caches(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, configs):
    """Prefill once and build every config's compressed cache.

    Returns
    -------
    (logits, caches, kept, position_ids, model_mask)
        ``logits`` [b, vocab] at the last prompt token (the same for every config); one cache per
        config (its compressed layers plus shallow copies of the shared full ones) and the per-layer
        ``kept_positions`` of each; the prompt's position ids and the mask the model saw.
    """
    configs = [dict(c) for c in configs]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    modules = attention_modules(model)
    saved = _save(model, modules)
    try:
        plans = []
        for c in configs:  # each config's layer plans, with the checks of a separate run
            configure(model, **c)
            plans.append([m._restkv for m in modules])
        configure(model, method="fullkv")
        kept = [[None] * len(modules) for _ in configs]
        sinks = [_Sink() for _ in configs]
        hook = functools.partial(_evict_each, plans, sinks, kept, {m: i for i, m in enumerate(modules)})
        for m in modules:
            m._restkv_evict = hook
        position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        model_mask = None if bool((mask == 1).all()) else mask
        out = model(input_ids=input_ids, attention_mask=model_mask, position_ids=position_ids, use_cache=True,
                    logits_to_keep=1)
        for m in modules:
            m._restkv_evict = None
        full = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        caches = []
        for sink in sinks:
            cache = copy.copy(full)
            cache.layers = [sink.layers.get(j) or copy.copy(layer) for j, layer in enumerate(full.layers)]
            caches.append(cache)
        return out.logits[:, -1], caches, kept, position_ids, model_mask
    finally:
        _restore(model, modules, saved)


@torch.no_grad()
def sweep(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, configs, max_new_tokens: int,
          eos_token_id=_ABSENT, pad_token_id: int | None = None) -> list[tuple[Tensor, list[Tensor | None]]]:
    """Evaluate several eviction configs on one prompt for the price of one prefill.

    Parameters
    ----------
    model : nn.Module
        A causal LM of a supported family and backend.
    input_ids, attention_mask : Tensor
        [b, n] prompt, left padded; ``attention_mask`` None means no padding.
    configs : iterable of dict
        Keyword knobs of ``restkv.configure`` / ``CompressionConfig.from_kwargs``, one dict per config.
    max_new_tokens : int
        Tokens to generate per config.
    eos_token_id, pad_token_id : optional
        As in ``generate``; by default the model's generation config. ``eos_token_id=None`` never stops.

    Returns
    -------
    One ``(tokens, kept)`` per config, equal to what ``configure(model, **cfg)`` then
    ``model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=False)`` give:
    ``tokens`` [b, <= max_new_tokens] the generated ids (prompt excluded, ``pad_token_id`` after EOS),
    ``kept`` the per-layer list of ``restkv.kept_positions(model)``.

    The model's own configuration is restored afterwards.
    """
    eos, pad = _eos_and_pad(model, eos_token_id, pad_token_id, input_ids.device)
    logits, caches, kept, position_ids, model_mask = prefill_caches(model, input_ids, attention_mask, configs)
    first = logits.float().argmax(-1).to(input_ids.device)
    modules = attention_modules(model)
    saved = _save(model, modules)
    try:
        configure(model, method="fullkv")  # decoding reads each cache's own layers
        results = []
        for i in range(len(caches)):
            cache, caches[i] = caches[i], None
            results.append((_decode(model, cache, first, position_ids, model_mask, max_new_tokens, eos, pad), kept[i]))
        return results
    finally:
        _restore(model, modules, saved)
