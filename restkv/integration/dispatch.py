"""The wrapped attention functions: sdpa, flash-attention and each family's eager attention, a pass-through
for modules without an attachment; on an attached layer, eviction at prefill and the kept entries' attention
while decoding (``restkv.integration.attachment``)."""

from __future__ import annotations

import functools

import torch
from transformers.modeling_utils import AttentionInterface

from ..cache import KeptLayer, VarlenLayer, masked_attention
from ..eviction import decode
from ..eviction.plans import backend_kind
from ..scoring.rope import Rope
from . import chunked
from .cache_checks import PREFILL_LAYERS


def _attention_with_eviction(backend, kind, module, query, key, value, attention_mask, **kwargs):
    state = getattr(module, "_restkv", None)  # its LayerState, if attached
    if (
        state is not None and state.replay is not None
    ):  # a pass after the prefill that a deferred selection reads
        out = backend(module, query, key, value, attention_mask, **kwargs)
        state.replay(query, key, value)
        return out
    if state is None or state.cache is None or not state.plan.evicts:
        return backend(module, query, key, value, attention_mask, **kwargs)
    layer = state.cache.layers[module.layer_idx]
    if isinstance(layer, (VarlenLayer, KeptLayer)):
        out = _attend_kept(layer, backend, kind, state, module, query, key, value, kwargs)
        if (
            getattr(layer, "policy", None) is not None
        ):  # eviction while decoding (``decode_interval``), in place after the decoder's forward
            shrunk = decode.decode_step(state.cache, module, query, kwargs)
            if shrunk is not None:
                state.shrinks.append(shrunk)
        return out
    out = backend(module, query, key, value, attention_mask, **kwargs)
    if type(layer) not in PREFILL_LAYERS:
        return out
    if state.chunks is not None:  # a chunk of a chunked prefill: evicted after the last one
        chunked.record(state, query, key, attention_mask, kwargs)
    elif query.shape[2] == key.shape[2]:  # prefill of a fresh cache
        prompt = state.prompt_length or query.shape[2]
        if (
            prompt < query.shape[2]
        ):  # more tokens in the prompt's forward (an assistant's candidates)
            return _prefill_then_decode(
                out, prompt, backend, kind, state, module, query, key, value, attention_mask, kwargs
            )
        state.on_prefill(state, module, query, key, value, attention_mask, kwargs)
    return out


def _attend_kept(layer, backend, kind, state, module, query, key, value, kwargs):
    """The attention of ``query`` [b, Hq, q, d] over a layer holding kept entries (``key``, ``value``
    what its update returned): the packed layout attends itself, the dense one through the backend
    with its mask (on flash, sdpa where one padding mask per sample cannot express it)."""
    scaling = kwargs.get("scaling") or module.head_dim**-0.5
    if isinstance(layer, VarlenLayer):
        return layer.attend(query, scaling, kwargs.get("softcap")), None
    groups = query.shape[1] // key.shape[1]
    mask = layer.attention_mask(query.shape[2], kind, query.dtype, groups, state.plan.window)
    if kind == "flash" and mask is not None and mask.dim() == 4:  # heads or a window differ: sdpa
        out = masked_attention(query, key, value, mask, scaling, kwargs.get("softcap"))
        return out.transpose(1, 2).contiguous(), None
    return backend(module, query, key, value, mask, **kwargs)


def _prefill_then_decode(
    out, prompt, backend, kind, state, module, query, key, value, attention_mask, kwargs
):
    """A fresh cache given the ``prompt`` and more tokens in one forward: evict over the prompt (whose
    outputs the full forward ``out`` holds), then the rest are decoded tokens attending the kept
    entries, as if fed one forward later."""
    if state.plan.deferred:
        raise ValueError(
            f"method={state.plan.cfg.method!r}: a selection deferred after the prefill "
            "cannot take tokens in the prefill's forward (assisted decoding); "
            "generate without an assistant"
        )
    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = attention_mask[:, :prompt]
    elif attention_mask is not None:
        attention_mask = attention_mask[..., :prompt, :prompt]
    rope = state.rope
    if rope is not None:
        after = rope.next_position - (query.shape[2] - prompt)
        state.rope = Rope(rope.cos[:, :prompt], rope.sin[:, :prompt], after, rope.embed)
    hidden = state.hidden
    state.hidden = None if hidden is None else hidden[:, :prompt]
    head = (x[:, :, :prompt] for x in (query, key, value))
    state.on_prefill(state, module, *head, attention_mask, kwargs)
    state.rope = rope
    state.hidden = hidden
    layer = state.cache.layers[module.layer_idx]
    if not isinstance(layer, (VarlenLayer, KeptLayer)):  # nothing evicted: the full forward stands
        return out
    keys, values = layer.update(key[:, :, prompt:], value[:, :, prompt:])
    queries = query[:, :, prompt:]
    tail, _ = _attend_kept(layer, backend, kind, state, module, queries, keys, values, kwargs)
    return torch.cat([out[0][:, :prompt], tail], 1), None


def _wrap(backend, kind):
    if getattr(backend, "_restkv_wrapped", False):
        return backend
    wrapped = functools.partial(_attention_with_eviction, backend, kind)
    wrapped = functools.wraps(backend)(wrapped)
    wrapped._restkv_wrapped = True
    return wrapped


def install(*modeling_modules) -> None:
    """Route sdpa / flash-attention and the given families' eager attention through restkv.

    Idempotent, and a pass-through for models without an attachment. Every registered backend restkv
    attends through is wrapped: sdpa and the flash ones, hub kernels' names included (``backend_kind``).
    """
    for name in list(AttentionInterface._global_mapping):
        wrap_backend(name)
    for mod in modeling_modules:
        if hasattr(mod, "eager_attention_forward"):
            mod.eager_attention_forward = _wrap(mod.eager_attention_forward, "eager")


def wrap_backend(name: str) -> None:
    """Wrap the attention function registered as ``name`` (sdpa or a flash kernel), if not yet.
    transformers registers a hub kernel again when it first loads it, in the first forward: each
    layer's forward checks."""
    backend = AttentionInterface._global_mapping.get(name)
    kind = backend_kind(name)
    wrapped = getattr(backend, "_restkv_wrapped", False)
    if backend is not None and kind not in (None, "eager") and not wrapped:
        AttentionInterface.register(name, _wrap(backend, kind))
