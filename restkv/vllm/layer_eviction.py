"""A worker's eviction of one request in one attention layer (``LayerEviction``, a part of
``restkv.vllm.worker.Worker``): its observation (the entries it holds, read back, and its most recent
queries from the ring), a ``SUMMED`` method's chunk scores, the selection and the kept entries written,
and a budget shared across layers (``settings.deferred``): each layer's scores kept, selected once every
layer has run (``_finish``). The model's layers as an eviction reads them (``index_layers``): each
one's index among the model's attention layers, its o_proj weight and W_O factor. No vLLM import here.

Memory (``restkv.vllm.memory`` counts it): during an eviction the entries the request holds, read back
once (one copy of its K+V), plus the selection's own; a ``SUMMED`` method's prefill [Hq, L] float32
scores per request.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from ..scoring.observe import wo_factor
from ..strategies.budgets import shared_sizes
from . import settings
from .heads import stage
from .memory import reads_factor
from .ranks import layer_sizes, layers_sizes
from .scoring import chunk_score, entry_scores, kept_entries, observation, slot_rows
from .state import Scheduled

_LAYER = re.compile(r"\.(\d+)\.")


class LayerEviction:
    """The ``Worker``'s part that evicts a request in a layer (its state: ``restkv.vllm.worker.Worker``)."""

    # ---- the model's layers ----

    def index_layers(self, names_to_o_proj: dict, heads: int | None = None, evicted=None) -> None:
        """``{attention layer name: a function returning its o_proj weight, or None}`` (read again
        when a selection needs the weight itself); with ``heads`` (Hq) each layer's W_O factor is
        computed now when the config reads it, so the weight is never held. ``evicted``: the model's layer
        numbers eviction applies to, in order (``restkv.strategies.layers.evicted_layers``: a hybrid model's
        full-attention layers; every layer where this worker holds some, a pipeline stage). A layer is numbered
        as ``restkv.configure`` numbers it, by its rank among them (its number read off its name:
        ``model.layers.15`` is the 16th), where every name has a number among them; else in order, of these."""
        self.o_proj.update({n: f for n, f in names_to_o_proj.items() if f is not None})
        if heads and reads_factor(self.cfg):
            for name in names_to_o_proj:
                if name in self.o_proj:
                    self._factor(name, heads)
        rank = {number: i for i, number in enumerate(evicted or ())}
        numbers = {n: int(m.group(1)) for n in names_to_o_proj if (m := _LAYER.search(n))}
        if len(numbers) == len(names_to_o_proj) and set(numbers.values()) <= rank.keys():
            self.layer_index = {name: rank[number] for name, number in numbers.items()}
            self.layers = len(rank)
        else:
            self.layer_index = {name: i for i, name in enumerate(names_to_o_proj)}
            self.layers = max(len(names_to_o_proj), 1)

    def leave(self, group: int, layers) -> None:
        """Evict KV cache group ``group`` only, whose attention layers are ``layers`` (names): the others, a
        hybrid model's sliding windows, are neither read, scored nor cut. The layers indexed (those without
        a sliding window: ``index_layers``) must be the group's, else a RuntimeError names the first that
        differs."""
        differ = sorted(set(layers) ^ self.layer_index.keys())
        if differ:
            name = differ[0]
            where = "has no sliding window but is not" if name in self.layer_index else "has a sliding window but is"
            raise RuntimeError(
                f"restkv.vllm: layer {name} {where} in the KV cache group the plugin evicts (group {group}); "
                "this model's layers are not ones the plugin evicts"
            )
        self.group = group

    def _observe(
        self, name, s: Scheduled, queries, keys, values, budget, scale, softcap, window=None, head_valid=None
    ):
        return observation(
            s.cfg,
            queries,
            keys,
            values,
            budget,
            scale,
            softcap,
            self.layer_index.get(name, 0),
            self.layers,
            self.o_proj.get(name),
            (lambda: self._factor(name, queries.shape[1])) if name in self.o_proj else None,
            window,
            head_valid,
            None if self.ranks is None else self.ranks.gather,
        )

    def _factor(self, name: str, heads: int) -> torch.Tensor:
        """The layer's W_O factor R [Hq, d, d], computed once."""
        if name not in self.factors:
            self.factors[name] = wo_factor(self.o_proj[name](), heads)
        return self.factors[name]

    def _add_chunk(self, name, s: Scheduled, query, paged, scale, softcap) -> None:
        keys, values = paged.read(s.held_slots)
        chunk = query[s.start : s.start + s.count]
        obs = self._observe(name, s, chunk, keys, values, s.end, scale, softcap, window=0)
        part = chunk_score(obs, s.cfg)
        before = s.state.sums.get(name)
        if before is not None:
            part[:, : before.shape[1]] += before
        s.state.sums[name] = part

    def _observed(self, name, s: Scheduled, paged, scale, softcap):
        """The request's observation in layer ``name`` at its eviction: the entries it holds, read back
        (from its heads' pages once it evicted with per-head budgets, laid out as ``HeadPages.layout`` at
        the widest head's width over every rank, as one device lays them out), and its most recent queries
        from the ring."""
        e = s.eviction
        if name in s.state.pages:
            pages = s.state.pages[name]
            width = pages.width() if self.ranks is None else self.ranks.most([pages.width()])[0]
            slots, held = pages.layout(s.cfg.window_size, width)  # every rank at one device's width
            heads, width = held.shape
            slots, held = stage([slots.reshape(-1), held.reshape(-1).astype(np.int64)], paged.cache.device)
            read = paged.dequantized(*self.whole.read_pages(slots))  # through this layer's scales
            keys, values = (x.view(heads, width, -1).transpose(0, 1) for x in read)
            head_valid = held.view(1, heads, width).bool()
            s.read_from[name] = slots.view(heads, width)
        else:
            keys, values = paged.read(s.held_slots)
            head_valid = None
            s.read_from.pop(name, None)
        queries = self.ring.read(name, s.state.slot, s.end, min(settings.query_rows(s.cfg), s.end))
        index, layers = self.layer_index.get(name, 0), self.layers
        length = settings.schedule_length(s.cfg, s.prompt_len, s.end, s.computed < s.prompt_len)
        budget = settings.layer_budget(s.cfg, e.budget, length, index, layers)
        return self._observe(name, s, queries, keys, values, budget, scale, softcap, head_valid=head_valid)

    def _evict(self, name, s: Scheduled, paged, scale, softcap) -> None:
        obs = self._observed(name, s, paged, scale, softcap)
        table = settings.layer_table(s.cfg, self.layer_index.get(name, 0), obs.keys.device)
        summed = s.state.sums.pop(name, None)
        if self.ranks is None or not settings.sized_across_heads(s.cfg):
            kept = kept_entries(obs, s.cfg, summed, table)
        else:  # the heads' split over every rank's heads
            scores = entry_scores(obs, s.cfg, summed)
            fit, sizes = layer_sizes(self.ranks, obs, s.cfg, scores, table)
            kept = kept_entries(obs, s.cfg, sizes=sizes, scores=scores, fit=fit)
        self._keep(name, s, kept, paged)

    def _keep(self, name, s: Scheduled, kept, paged) -> None:
        heads = kept.keys.shape[1]
        if settings.per_head(s.cfg):
            self._place(name, s, kept, paged)
        else:
            rows = slot_rows(kept) if paged.scales is None else paged.stored(s.held_slots, kept.positions[0])
            paged.write(s.kept_slots, *rows)  # an FP8 cache's as stored: its bytes
            s.dropped += heads * max(0, s.eviction.held - kept.positions.shape[-1])
        s.heads += heads
        if not s.state.evicted and self.observer is not None:
            self.observer(s.req_id, name, kept.positions[0])

    def _score(self, name, s: Scheduled, paged, scale, softcap) -> None:
        """A deferred eviction's scores in layer ``name`` (``settings.deferred``); it selects in ``_finish``."""
        obs = self._observed(name, s, paged, scale, softcap)
        s.scores[name] = entry_scores(obs, s.cfg, s.state.sums.pop(name, None))
        self.later[name] = (paged, scale, softcap)

    def _finish(self, s: Scheduled) -> None:
        """A deferred eviction once every layer has run: the layers' shares of the budget from all their
        scores (``shared_sizes``, as ``restkv.configure``), its kept count from them (``_measure_kept``), then each
        layer's selection placed on its pages."""
        names = sorted(s.scores, key=self.layer_index.get)
        scores = [s.scores.pop(n) for n in names]
        if self.ranks is None:
            fit, sizes = [None] * len(names), shared_sizes(s.cfg, scores, s.eviction.budget)
        else:  # over every rank's heads
            fit, sizes = layers_sizes(self.ranks, s.cfg, scores, s.eviction.budget)
        lengths = torch.stack(sizes)[:, 0] + s.cfg.window_size  # [layers, Hkv]
        self._measure_kept(s, lengths.cpu().numpy())  # one host read per eviction; its own blocks (``settings.uncached``)
        for name, size, score, whole in zip(names, sizes, scores, fit):
            paged, scale, softcap = self.later[name]
            obs = self._observed(name, s, paged, scale, softcap)
            self._keep(name, s, kept_entries(obs, s.cfg, sizes=size, scores=score, fit=whole), paged)
