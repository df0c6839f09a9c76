"""Attaching eviction to a model: the one integration path for every family and backend.

transformers 5 dispatches attention through ``ALL_ATTENTION_FUNCTIONS`` (sdpa, flash-attention)
or each family's module-level ``eager_attention_forward``. restkv wraps those functions once
(``install``); the wrapper passes through for modules without an attachment. On an attached layer it

- at prefill (an empty cache receiving the whole prompt): runs the backend on the full cache, then
  hands the layer's tensors to the attachment's ``on_prefill`` (by default ``evict_layer``, whose
  result replaces the layer's cache);
- when decoding on a layer that holds kept entries: supplies their mask (or attends over the packed
  per-head layout itself), and with ``decode_interval`` evicts again every that many new tokens.

An attachment is one ``LayerState`` per attention module (``module._restkv``), the model's
``model._restkv``, two hooks per module that hand the state the forward's cache and RoPE, and one on
the decoder that finishes deferred selections once the prefill forward has returned (``restkv.eviction.deferred``:
a cross-layer budget, passes after the prefill); ``detach`` removes all of it. ``restkv.integration.attach``
builds the public calls on it. The wrapped functions are in ``dispatch``, the checks of the cache a forward is
given in ``cache_checks``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..eviction import decode
from ..eviction.deferred import decoder_of, finish
from ..eviction.step import evict_layer
from ..eviction.plans import LayerPlan, attention_modules
from ..scoring.rope import Rope, capture, rotary_function, rotary_module
from ..strategies import rerotate
from . import chunked, modes
from .cache_checks import PREFILL_LAYERS, check_cache
from .dispatch import install, wrap_backend


def evict_into_cache(state, module, query, key, value, attention_mask, kwargs) -> None:
    """The default prefill step: evict, and put the kept entries in place of the layer's full cache
    (a deferred plan leaves its layer in ``state.pending`` for the decoder's hook)."""
    if (
        state.pending and state.pending[-1][1] is not state.cache
    ):  # left by a prefill that did not return
        del state.pending[:]
    deferred = []
    layer, state.kept = evict_layer(
        state.plan,
        module,
        query,
        key,
        value,
        attention_mask,
        kwargs,
        rope=state.rope,
        pending=deferred,
        hidden=state.hidden,
    )
    state.pending.extend((prefill, state.cache) for prefill in deferred)
    if layer is not None:
        state.cache.layers[module.layer_idx] = layer


@dataclass
class LayerState:
    """An attached layer: its plan, what to do at prefill, the cache and RoPE of the forward in flight, what it kept."""

    plan: LayerPlan
    on_prefill: Callable = evict_into_cache
    cache: object = None
    kept: torch.Tensor | None = None  # [b, Hkv, kept] positions of the last prefill
    embed: Callable | None = (
        None  # positions -> (cos, sin) of the layer's RoPE (``restkv.scoring.rope.rotary_function``)
    )
    rope: Rope | None = None
    pending: list | None = (
        None  # the attachment's deferred layers of the prefill in flight: (LayerPrefill, cache)
    )
    replay: Callable | None = (
        None  # ``replay(query, key, value)`` after a pass's attention (``restkv.eviction.deferred``)
    )
    shrinks: list | None = (
        None  # the attachment's layers shrunk while decoding, to put in place (``decode.finish``)
    )
    prompt_length: int | None = None  # the prompt of the generate() in flight (``modes``)
    chunks: "chunked.Chunks | None" = None  # what a chunked prefill recorded (``chunked``)
    hidden: torch.Tensor | None = (
        None  # [b, n, D] the prefill forward's attention input, for a method that reads it
    )


def _capture(module, args, kwargs):
    wrap_backend(getattr(getattr(module, "config", None), "_attn_implementation", None))
    state = module._restkv
    state.cache = kwargs.get("cache", kwargs.get("past_key_values"))
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    check_cache(state, state.cache, module.layer_idx)
    # only a prefill's scorers read the forward's RoPE (a chunked prefill's every chunk): no capture (no
    # kernel) per decoded token
    fresh = state.cache is None or state.cache.get_seq_length(module.layer_idx) == 0
    prefill = fresh or state.chunks is not None
    state.rope = (
        capture(state.embed, kwargs, hidden.shape[0]) if prefill and hidden is not None else None
    )
    state.hidden = hidden if prefill else None  # a reference for the forward's span only


def _release(module, args, kwargs, output):
    module._restkv.cache = module._restkv.rope = module._restkv.hidden = None


class Attachment:
    """Eviction attached to a model: a ``LayerState`` per attention module and two hooks each.

    Parameters
    ----------
    model : nn.Module
    plans : list of LayerPlan
        One per attention module (``plan_layers``).
    on_prefill : callable, optional
        ``on_prefill(state, module, query, key, value, attention_mask, kwargs)`` at each layer's prefill;
        default ``evict_into_cache``. Sweep mode passes one that evaluates many configs.
    """

    def __init__(
        self, model: nn.Module, plans: list[LayerPlan], on_prefill: Callable | None = None
    ):
        self.model = model
        self.modules = attention_modules(model)
        self.cfg = plans[0].cfg
        rotary = [rotary_module(model, m) for m in self.modules]
        if any(rerotate.applies(p.cfg) and r is None for p, r in zip(plans, rotary) if p.evicts):
            raise ValueError("rerotate_keys needs a model whose evicted layers use RoPE")
        self.pending: list = []  # deferred layers of the prefill in flight, shared by the states
        self.shrinks: list = []  # layers shrunk while decoding in the forward in flight, shared too
        self.states = [
            LayerState(
                p,
                on_prefill or evict_into_cache,
                embed=None if r is None else rotary_function(r, m),
                pending=self.pending,
                shrinks=self.shrinks,
            )
            for p, m, r in zip(plans, self.modules, rotary)
        ]
        self._hooks: list = []

    def attach(self) -> "Attachment":
        if getattr(self.model, "_restkv", None) is not None:
            raise RuntimeError("the model already has an attachment; detach it first")
        install(*{sys.modules[type(m).__module__] for m in self.modules})
        for m, state in zip(self.modules, self.states):
            m._restkv = state
            self._hooks += [
                m.register_forward_pre_hook(_capture, with_kwargs=True),
                m.register_forward_hook(_release, with_kwargs=True),
            ]
        self._hooks.append(
            decoder_of(self.model).register_forward_hook(self._finish, with_kwargs=True)
        )
        if hasattr(
            self.model, "_prefill"
        ):  # generate()'s prefill: chunked, evicts after the last chunk
            prefill = self.model._prefill
            self.model._prefill = functools.partial(
                chunked.chunked_prefill, self, prefill, PREFILL_LAYERS
            )
        if hasattr(
            self.model, "generate"
        ):  # modes checked, the prompt's length known (assisted decoding)
            self.model.generate = functools.partial(modes.generate, self, self.model.generate)
        self.model._restkv = self
        return self

    def _finish(self, decoder, args, kwargs, output) -> None:
        """After a forward of the decoder: put the layers shrunk while decoding in place, finish the
        deferred layers of its prefill, if any."""
        decode.finish(self.shrinks)
        self.finish_pending(kwargs.get("input_ids", args[0] if args else None))

    def finish_pending(self, input_ids) -> None:
        """Finish the deferred layers of the prefill of ``input_ids`` [b, n], if any."""
        if not self.pending:
            return
        (_, cache), prefills = self.pending[0], [p for p, _ in self.pending]
        del self.pending[:]  # the passes' own forwards find nothing to finish
        for prefill, layer, positions in finish(self.model, cache, prefills, input_ids):
            prefill.module._restkv.kept = positions
            if layer is not None:
                cache.layers[prefill.module.layer_idx] = layer

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for name in ("_prefill", "generate"):
            if name in vars(self.model):
                delattr(self.model, name)
        for m in self.modules:
            if getattr(m, "_restkv", None) is not None:
                del m._restkv
        if getattr(self.model, "_restkv", None) is self:
            del self.model._restkv


def detach(model: nn.Module) -> None:
    """Remove eviction from ``model`` (its hooks and attributes); a no-op when none is attached."""
    attachment = getattr(model, "_restkv", None)
    if attachment is not None:
        attachment.detach()


@contextlib.contextmanager
def attached(model: nn.Module, plans: list[LayerPlan], on_prefill: Callable | None = None):
    """Attach ``plans`` for the block, then restore whatever was attached before (or nothing)."""
    previous = getattr(model, "_restkv", None)
    if previous is not None:
        previous.detach()
    attachment = Attachment(model, plans, on_prefill).attach()
    try:
        yield attachment
    finally:
        attachment.detach()
        if previous is not None:
            previous.attach()
