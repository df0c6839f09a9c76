"""Chunked prefill (``generate(..., prefill_chunk_size=N)``): one eviction after the last chunk,
over the whole prompt.

transformers' ``_prefill`` runs the prompt as forwards of N tokens into the same cache. While it
runs, an attached layer records each chunk's queries [b, Hq, N, d], which of the chunk's keys are
real tokens and its RoPE instead of evicting (``record``); once the last chunk has returned, each
layer is evicted from its full cache with every chunk's queries, as an unchunked prefill is (the
same kept entries, cache and tokens for every method), and the deferred selections are finished. The
prompt's queries are held until then: [b, Hq, L, d] per layer, Hq / Hkv times the keys.

A prefill that starts from a cache holding tokens already (a continued conversation) evicts nothing,
as without chunks. Layers that evict among a sliding window's entries (a model whose every layer is
sliding-window) would need the entries the window has dropped: ``check`` refuses them before any
forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..eviction.step import key_valid_of
from ..scoring.rope import Rope


@dataclass
class Chunks:
    """What a layer recorded of the chunks of a prefill."""

    queries: list = field(default_factory=list)  # [b, Hq, n_i, d] per chunk
    valid: list = field(default_factory=list)  # [b, n_i] bool per chunk: real tokens
    ropes: list = field(default_factory=list)  # the chunks' ``Rope`` (None when the layer has none)
    kwargs: dict = field(default_factory=dict)  # the last chunk's backend arguments (scaling...)
    hidden: list = field(default_factory=list)  # [b, n_i, D] per chunk, for a method that reads it

    @property
    def length(self) -> int:
        return sum(q.shape[2] for q in self.queries)

    def rope(self) -> Rope | None:
        """The whole prompt's RoPE: the chunks' cos/sin joined, the next position after them."""
        if not self.ropes or any(r is None for r in self.ropes):
            return None
        last = self.ropes[-1]
        cos = torch.cat([r.cos for r in self.ropes], 1)
        sin = torch.cat([r.sin for r in self.ropes], 1)
        return Rope(cos, sin, last.next_position, last.embed)


def record(state, query, key, attention_mask, kwargs) -> None:
    """Keep a chunk's queries [b, Hq, n, d], its keys' validity (read off the backend's
    ``attention_mask`` over the ``key`` [b, Hkv, past + n, d] it attends) and its RoPE."""
    b, _, n, _ = query.shape
    total = key.shape[2]
    mask = attention_mask
    if mask is not None and mask.dim() == 4:  # the columns of the chunk's own keys
        mask = mask[..., total - n : total]
    state.chunks.queries.append(query)
    state.chunks.valid.append(key_valid_of(mask, b, n, query.device))
    state.chunks.ropes.append(state.rope)
    state.chunks.kwargs = kwargs
    if state.hidden is not None and state.plan.cfg.scorer.reads_hidden:
        state.chunks.hidden.append(state.hidden)


def check(attachment, chunk_size) -> None:
    """Refuse, before any forward, a chunked prefill that eviction cannot follow."""
    if chunk_size is None:
        return
    states = attachment.states
    if any(s.plan.evicts and s.plan.window is not None and s.plan.cfg.evicts for s in states):
        raise ValueError(
            "prefill_chunk_size: eviction on a model whose evicted layers are "
            "sliding-window needs the whole prompt's entries in one forward; "
            "generate without prefill_chunk_size"
        )


def evict_recorded(attachment, cache, layer_types: tuple) -> None:
    """After the last chunk: evict each layer that recorded the whole prompt, from its cache."""
    for module, state in zip(attachment.modules, attachment.states):
        chunks, state.chunks = state.chunks, None
        if chunks is None or not chunks.queries:
            continue
        layer = cache.layers[module.layer_idx]
        continued = layer.keys.shape[2] != chunks.length  # the cache held tokens before
        if type(layer) not in layer_types or continued:
            state.kept = None
            continue
        query = torch.cat(chunks.queries, 2)
        valid = torch.cat(chunks.valid, 1)
        del chunks.queries[:]
        state.cache = cache
        state.rope = chunks.rope()
        state.hidden = torch.cat(chunks.hidden, 1) if chunks.hidden else None
        del chunks.hidden[:]
        try:
            state.on_prefill(state, module, query, layer.keys, layer.values, valid, chunks.kwargs)
        finally:
            state.cache = state.rope = state.hidden = None


def chunked_prefill(
    attachment, prefill, layer_types, input_ids, generation_config, model_kwargs, *args, **kwargs
):
    """transformers' ``_prefill``, evicting once after the last chunk (the module's docstring)."""
    chunk_size = getattr(generation_config, "prefill_chunk_size", None)
    if chunk_size is None:
        return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
    check(attachment, chunk_size)
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    for state in attachment.states:
        state.chunks = Chunks()
    try:
        outputs = prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        returned = getattr(outputs, "cache", getattr(outputs, "past_key_values", None))
        cache = cache if returned is None else returned
        evict_recorded(attachment, cache, layer_types)
    finally:
        for state in attachment.states:
            state.chunks = None
    attachment.finish_pending(input_ids)
    return outputs
