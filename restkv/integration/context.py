"""A context compressed once, many questions: ``compress_context``.

The context is prefilled on the full cache and evicted without knowing the question (question-agnostic:
the observation window is the context's last tokens); every question then reads the same compressed
cache, its positions continuing from the full context length (as kvpress's pipeline does)::

    cache = restkv.compress_context(model, context_ids, method="snapkv", max_capacity_prompt=256)
    for question_ids in questions:  # [b, m] each
        out = model.generate(torch.cat([context_ids, question_ids], 1), cache=cache, max_new_tokens=32)  # or past_key_values=cache

Built from the public pieces: ``sweeps.prefill_caches`` (one prefill, ``evict.evict_layer`` per layer under
an ``attach.attached`` attachment) and, for greedy answers without ``generate``, sweep mode's decoding loop.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache

from .attach import check_family, configure
from .attachment import attached
from .generation import ABSENT, eos_and_pad, forward, full_plans, greedy_decode, positions_and_mask
from .sweeps import prefill_caches


class ContextCache(DynamicCache):
    """A compressed context that ``generate()`` reads without changing it.

    ``generate()`` grows the cache it is given in place; this one keeps the compressed layers as returned
    (``context_layers``) and decodes on shallow copies of them (``layers``), made afresh at the start of
    every ``generate()`` (transformers marks a cache passed to it, and the mark rewinds this one) or by
    ``rewind()``. No tensor is copied then: a layer's first new entry concatenates its tensors into new ones,
    as transformers' dynamic layers do at every step, so the context's tensors are never written. The cost
    per question: one copy of the compressed layer's bytes at its first decoding step (work decoding on
    any dynamic cache does anyway) and a Python object per layer.

    Attributes
    ----------
    context_layers : list
        The compressed layers (evicted layers, and the full ones of layers that keep everything).
    context_length : int
        Tokens of the context (padding included): the position after it is where a question starts.
    logits : Tensor
        [b, vocab] the model's next-token logits after the context.
    batch : int
        ``b``: the contexts; a question of another batch is refused (``ValueError``).
    kept : list
        Per layer, the kept context positions (as ``restkv.kept_positions``).
    context_ids : Tensor or None
        [b, n] the context's tokens: a ``generate()`` input must begin with them (None: not checked).
    """

    def __init__(self, cache: DynamicCache, logits: Tensor, kept: list, context_ids: Tensor | None = None):
        self.__dict__.update(cache.__dict__)
        self.context_layers = list(cache.layers)
        self.context_length = cache.get_seq_length()
        self.context_ids = context_ids
        self.logits = logits
        self.kept = kept
        self.batch = logits.shape[0]
        self.rewind()

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """``DynamicCache.update``, refusing questions of another batch than the contexts' (ValueError)."""
        if key_states.shape[0] != self.batch:
            raise ValueError(
                f"this compressed context holds a batch of {self.batch}; its questions must come as a batch "
                f"of {self.batch} too (row i reads context i), got {key_states.shape[0]}"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_prompt(self, input_ids) -> None:
        """Refuse (ValueError, before any forward) a ``generate()`` input [b, N] that is not the context this
        cache was compressed from followed by at least one token: ``generate()`` skips the first ``n`` tokens of
        its input, so another context would be answered from this one, and a question alone reads nothing."""
        if self.context_ids is None or not isinstance(input_ids, Tensor) or input_ids.shape[0] != self.batch:
            return  # nothing to compare with; another batch is refused by update()
        n = self.context_length
        if input_ids.shape[-1] <= n:
            got = f"{input_ids.shape[-1]} tokens"
        elif not torch.equal(input_ids[:, :n], self.context_ids.to(input_ids.device)):
            got = f"{input_ids.shape[-1]} tokens whose first {n} are another context"
        else:
            return
        raise ValueError(
            f"input_ids: a compressed context answers an input that begins with the {n}-token context it was "
            f"compressed from, then the question (torch.cat([context_ids, question_ids], 1)); got {got}"
        )

    def rewind(self) -> "ContextCache":
        """Back to the compressed context: drop whatever was appended (and evicted) since."""
        self.layers = [copy.copy(layer) for layer in self.context_layers]
        return self

    @property
    def _is_user_defined(self) -> bool:  # read by generate(): this cache outlives it
        return True

    @_is_user_defined.setter
    def _is_user_defined(self, value) -> None:  # set by every generate() that is given this cache
        self.rewind()


@torch.no_grad()
def compress_context(
    model: nn.Module, context_ids: Tensor, attention_mask: Tensor | None = None, **knobs
) -> ContextCache:
    """Prefill ``context_ids`` on the full cache, evict as ``restkv.configure(model, **knobs)`` would, and
    return the compressed cache for any number of questions.

    Parameters
    ----------
    model : nn.Module
        A causal LM of a supported family and backend.
    context_ids : Tensor
        [b, n] the context, left padded when ``attention_mask`` [b, n] marks padding: ``b`` contexts, each
        compressed on its own, and every question then a batch of ``b`` (row i reads context i; another
        batch is refused).
    **knobs
        As ``restkv.configure`` takes them (validated before any work); the observation window is the
        context's last ``window_size`` tokens.

    Returns
    -------
    ContextCache
        ``model.generate(cat([context_ids, question_ids], 1), cache=cache, ...)`` (or ``past_key_values=``) answers
        ``question_ids`` [b, m] (pass ``attention_mask=cat([attention_mask, ones])`` with a padded context)
        and leaves the cache as returned; an input that does not begin with ``context_ids`` is refused
        (``ValueError``, before any forward). If the model has no eviction attached, a full-cache one
        (``method="fullkv"``) is attached so its attention reads the compressed layers; a configuration
        set earlier stays (it does not touch a cache that is already compressed).
    """
    check_family(model)
    if not isinstance(context_ids, Tensor) or context_ids.dim() != 2 or context_ids.shape[1] < 1:
        got = f"shape {tuple(context_ids.shape)}" if isinstance(context_ids, Tensor) else type(context_ids).__name__
        raise ValueError(f"context_ids must be [batch, n] with n >= 1, got {got}")
    if attention_mask is not None and attention_mask.shape != context_ids.shape:
        raise ValueError(
            f"attention_mask must match context_ids {tuple(context_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    pre = prefill_caches(model, context_ids, attention_mask, [knobs])
    if getattr(model, "_restkv", None) is None:
        configure(model, method="fullkv")
    return ContextCache(pre.caches[0], pre.logits, pre.kept[0], context_ids)


@torch.no_grad()
def answer(
    model: nn.Module,
    cache: ContextCache,
    question_ids: Tensor,
    attention_mask: Tensor | None,
    max_new_tokens: int,
    eos_token_id=ABSENT,
    pad_token_id: int | None = None,
) -> Tensor:
    """Greedy answer to ``question_ids`` [b, m] on a compressed context (rewound first).

    ``attention_mask`` [b, n] is the context's (None: no padding). Returns the generated ids
    [b, <= max_new_tokens], as ``model.generate(cat([context, question], 1), past_key_values=cache,
    do_sample=False, ...)`` gives them (``pad_token_id`` after EOS).
    """
    if question_ids.shape[1] < 1:
        raise ValueError("question_ids must hold at least one token")
    if question_ids.shape[0] != cache.batch:
        raise ValueError(
            f"question_ids: a batch of {question_ids.shape[0]} on a compressed context of {cache.batch}"
        )
    eos, pad = eos_and_pad(model, eos_token_id, pad_token_id, question_ids.device)
    b, m = question_ids.shape
    context = (
        attention_mask
        if attention_mask is not None
        else question_ids.new_ones(b, cache.context_length)
    )
    mask = torch.cat([context, context.new_ones(b, m)], -1)
    position_ids, model_mask = positions_and_mask(mask)
    position_ids = position_ids[:, -m:]
    cache.rewind()
    with attached(model, full_plans(model)):  # decoding reads each cache's own layers
        out = forward(model, question_ids, model_mask, position_ids, cache)
        first = out.logits[:, -1].float().argmax(-1).to(question_ids.device)
        return greedy_decode(
            model, cache, first, position_ids, model_mask, max_new_tokens, eos, pad
        )[0]
