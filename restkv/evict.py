"""The eviction step of one layer at the end of prefill: observe, score, budget, select, cache layer.

``evict_layer`` is a function of the layer's prefill tensors and its plan only: ``configure()`` runs
it on the model's own cache, sweep mode runs it once per config on the same tensors. A selection
that needs every layer's prefill first (``LayerPlan.deferred``) is left as a ``LayerPrefill`` for
``restkv.deferred`` to finish once the model's prefill has returned.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from . import think
from .budgets import layer_budgets, sample_budgets
from .cache import cache_layer
from .config import CompressionConfig
from .observe import Observation, relative_positions, wo_factor
from .select import Kept, head_scores, select, stack_samples


@dataclass(frozen=True)
class LayerPlan:
    """What one attention layer does at prefill under a config."""

    cfg: CompressionConfig
    rank: int  # index among the evicted layers; -1: not evicted (sliding-window)
    num_evicted: int
    table: torch.Tensor | None = None  # HeadKV: entries per KV head, window excluded [Hkv]

    @property
    def evicts(self) -> bool:
        return self.rank >= 0

    @property
    def deferred(self) -> bool:
        """The selection waits for every layer's prefill: a global layer budget, or passes after the prefill."""
        cfg = self.cfg
        return cfg.evicts and (cfg.get("layer_budget") == "global" or cfg.scorer.replays)


class LayerPrefill:
    """One layer's prefill as the selection reads it: the batch as one observation (one budget for all
    samples) or one per sample (budgets that differ by sample: each on its own real tokens).

    ``release()`` drops the queries (a deferred layer keeps only its scores); observations made after
    it carry no query rows.
    """

    def __init__(self, plan: LayerPlan, module, query, key, value, attention_mask, kwargs, memo=None):
        b, hkv, n, _ = key.shape
        self.plan, self.module, self.key, self.value, self.n = plan, module, key, value, n
        self.query, self.query_shape = query, (query.shape[1], query.shape[3])
        self.key_valid = _key_valid(attention_mask, b, n, key.device)
        self.scaling, self.softcap = kwargs.get("scaling") or module.head_dim**-0.5, kwargs.get("softcap")
        cfg, self.memo = plan.cfg, {} if memo is None else memo
        by_ratio = cfg.get("max_capacity_prompt_ratio") is not None
        self.lengths = self.key_valid.sum(-1).tolist() if by_ratio else [n]  # one host read per layer with a ratio
        self.budgets = sample_budgets(cfg, self.lengths)
        self.batched = len(set(self.budgets)) == 1
        self.keeps_all = not cfg.evicts or all(length <= bud for length, bud in zip(self.lengths, self.budgets))
        ratio = cfg.get("pruning_ratio")
        self.energy = None if ratio is None else think.query_energy(query, self.key_valid, cfg.window_size)
        self.scores = None  # per part, when computed ahead of the selection

    @property
    def parts(self) -> list[tuple[slice, int, int]]:
        """(samples, first position, budget) of each observation."""
        if self.batched:
            return [(slice(None), 0, self.budgets[0])]
        return [(slice(i, i + 1), self.n - self.lengths[i], self.budgets[i]) for i in range(len(self.lengths))]

    def observation(self, part) -> Observation:
        sample, start, budget = part
        plan, cfg = self.plan, self.plan.cfg
        if self.query is None:
            b = self.key[sample].shape[0]
            queries = self.key.new_empty(b, self.query_shape[0], 0, self.query_shape[1])
        else:
            queries = self.query[sample, :, start:]
        memo = self.memo if self.batched else self.memo.setdefault(sample.start, {})
        return Observation(
            queries=queries, keys=self.key[sample, :, start:], values=self.value[sample, :, start:],
            key_valid=self.key_valid[sample, start:], window=cfg.window_size,
            budget=layer_budgets(cfg, plan.num_evicted, self.n - start, budget)[plan.rank],
            scaling=self.scaling, softcap=self.softcap, layer=plan.rank, num_layers=plan.num_evicted, memo=memo,
            wo_factor=lambda: layer_wo_factor(self.module, self.key.device),
        )

    def score(self, raw=None) -> None:
        """Keep each part's selection scores [b, H, P] (``raw``: the method's scores of every position [b, H, n])."""
        self.scores = []
        for part in self.parts:
            obs = self.observation(part)
            own = None if raw is None else raw[part[0], :, part[1] : part[1] + obs.prefix_len]
            self.scores.append(head_scores(obs, self.plan.cfg, own))

    def release(self) -> None:
        self.query, self.memo = None, {}

    def select(self, sizes=None) -> Kept:
        """The kept entries; ``sizes`` (per part, [b, Hkv] prefix entries per head) from a cross-layer budget."""
        cfg, b, hkv = self.plan.cfg, self.key.shape[0], self.key.shape[1]
        if self.keeps_all:
            return Kept(self.key, self.value, relative_positions(self.key_valid)[:, None].expand(-1, hkv, -1),
                        self.key_valid)
        kept = [select(self.observation(part), cfg, self.plan.table, None if sizes is None else sizes[i],
                       None if self.scores is None else self.scores[i]) for i, part in enumerate(self.parts)]
        return kept[0] if self.batched else stack_samples(kept)

    def result(self, kept: Kept):
        """(the cache layer holding ``kept``, or None: keep the full one; the kept positions [b, H, kept])."""
        ratio = self.plan.cfg.get("pruning_ratio")
        channels = None if ratio is None else think.kept_channels(kept.keys, kept.valid, self.energy, ratio)
        return cache_layer(kept, self.n, self.plan.cfg, channels), kept.positions


@torch.no_grad()
def evict_layer(plan: LayerPlan, module, query, key, value, attention_mask, kwargs, memo: dict | None = None,
                pending: list | None = None):
    """Select what the layer keeps from its prefill tensors.

    Parameters
    ----------
    plan : LayerPlan
    module : nn.Module
        The attention module (its ``o_proj`` gives ReST-KV's W_O factor, computed when a score reads it).
    query, key, value : Tensor
        [b, Hq, L, d], [b, Hkv, L, d], [b, Hkv, L, d] as the attention backend received them.
    attention_mask, kwargs
        The backend's mask and keyword arguments (``scaling``, ``softcap``).
    memo : dict, optional
        Shared by every config evaluated on this layer and prompt (window attention, scores).
    pending : list, optional
        Where a deferred plan's ``LayerPrefill`` goes (its scores computed, its queries released) when
        the layer evicts; the result is then (None, None) until ``restkv.deferred.finish``.

    Returns
    -------
    (layer, positions)
        The cache layer to put in place of the layer's full one (None: keep the full one) and the kept
        positions [b, Hkv, kept] (from each sample's first real token, -1 on kept padding).
    """
    prefill = LayerPrefill(plan, module, query, key, value, attention_mask, kwargs, memo)
    if plan.deferred and not prefill.keeps_all:
        if not plan.cfg.scorer.replays:
            prefill.score()
        prefill.release()
        pending.append(prefill)
        return None, None
    return prefill.result(prefill.select())


def _key_valid(mask, batch: int, n: int, device) -> torch.Tensor:
    """[b, n] bool: which keys are real tokens, read off whatever mask the backend received."""
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # flash-attention padding mask
        return mask[:, -n:].bool().expand(batch, n)
    row = mask[:, 0, -1, :n]  # the last query sees every real key
    row = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, n)


_WO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # o_proj -> (weight tag, R)


def layer_wo_factor(module, device) -> torch.Tensor:
    """The W_O factor R [Hq, d, d] of an attention module (computed once per weight), on ``device``.

    A layer offloaded by accelerate keeps its weights on the meta device between forwards; they are
    brought to ``device`` for the computation.
    """
    o_proj = module.o_proj
    w = o_proj.weight
    offloaded = w.device.type == "meta"
    tag = "offloaded" if offloaded else (w.data_ptr(), w._version, w.device, w.dtype)
    cached = _WO.get(o_proj)
    if cached is None or cached[0] != tag:
        if offloaded:
            from accelerate.utils import align_module_device

            weights_on = align_module_device(o_proj, execution_device=device)
        else:
            weights_on = contextlib.nullcontext()
        with torch.no_grad(), weights_on:
            cached = (tag, wo_factor(o_proj.weight, module.config.num_attention_heads))
        _WO[o_proj] = cached
    return cached[1].to(device)
