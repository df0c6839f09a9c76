"""The eviction step of one layer at the end of prefill: observe, score, budget, select, cache layer.

``evict_layer`` is a function of the layer's prefill tensors and its plan only: ``configure()`` runs
it on the model's own cache, sweep mode runs it once per config on the same tensors. A selection
that needs every layer's prefill first (``LayerPlan.deferred``) is left as a ``LayerPrefill`` for
``restkv.eviction.deferred`` to finish once the model's prefill has returned.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..strategies import blocks, compose, rerotate, think
from ..strategies.budgets import fits, layer_budgets, sample_budgets
from ..cache import CompressedLayer, cache_layer
from ..cache import Kept, stack_samples
from ..scoring.observe import Observation, relative_positions
from ..scoring.precision import float32_scoring
from ..scoring.rope import Rope
from .blocks import blockwise
from .compose import composed
from .decode import arm
from .observation import observation
from .plans import LayerPlan
from .select import head_scores, select

# selections made in steps, each by its strategy (one applies at a time: their checks refuse both)
STEPWISE = {compose: composed, blocks: blockwise}


class LayerPrefill:
    """One layer's prefill as the selection reads it: the batch as one observation (one budget for all
    samples) or one per sample (budgets that differ by sample: each on its own real tokens).

    On a sliding-window layer (``plan.window`` W) only the last W - 1 prompt entries can still be
    attended by the first decoded token: they are the entries it holds (``start`` the first of them).
    ``release()`` drops the queries (a deferred layer keeps only its scores); observations made after
    it carry no query rows.
    """

    def __init__(
        self,
        plan: LayerPlan,
        module,
        query,
        key,
        value,
        attention_mask,
        kwargs,
        memo=None,
        rope=None,
        hidden=None,
    ):
        b, _, n, _ = key.shape
        key_valid = key_valid_of(attention_mask, b, n, key.device)
        self.seen = n
        self.start = 0 if plan.window is None else max(0, n - plan.window + 1)
        if (
            self.start
        ):  # the entries older than the window are out of reach: evict among the visible ones
            self.offset = key_valid[:, : self.start].sum(-1)  # [b] real tokens before them
            query, key, value = (x[:, :, self.start :] for x in (query, key, value))
            hidden = None if hidden is None else hidden[:, self.start :]
            key_valid = key_valid[:, self.start :]
            n = n - self.start
        self.plan = plan
        self.module = module
        self.kwargs = kwargs
        self.rope = rope
        # kept after release(), for rerotate_keys
        self.embed = None if rope is None else rope.embed
        self.next_position = None if rope is None else rope.next_position
        self.query = query
        self.key = key
        self.value = value
        # [b, n, D] the attention input, held (until ``release``) only for a method that reads it
        self.hidden = hidden if plan.cfg.scorer.reads_hidden else None
        self.key_valid = key_valid
        self.n = n
        self.query_shape = (query.shape[1], query.shape[3])
        self.scaling, self.softcap = (
            kwargs.get("scaling") or module.head_dim**-0.5,
            kwargs.get("softcap"),
        )
        cfg = plan.cfg
        self.memo = {} if memo is None else memo
        by_ratio = cfg.get("max_capacity_prompt_ratio") is not None
        self.lengths = (
            key_valid.sum(-1).tolist() if by_ratio else [n]
        )  # one host read per layer with a ratio
        budgets = sample_budgets(cfg, self.lengths)
        self.batched = len(set(budgets)) == 1
        # this layer's budget per sample (each sample on its own real tokens when budgets differ by sample)
        starts = [0] if self.batched else [n - length for length in self.lengths]
        self.parts = [
            (
                slice(None) if self.batched else slice(i, i + 1),
                s,
                layer_budgets(cfg, plan.num_evicted, n - s, B)[plan.rank],
            )
            for i, (s, B) in enumerate(zip(starts, budgets))
        ]  # (samples, first position, budget)
        fit = [
            not cfg.evicts or fits(cfg, length, bud) for length, bud in zip(self.lengths, budgets)
        ]
        self.keeps_all = all(fit)
        # per part: it keeps every entry it holds, unscored (a sample within its budget or window)
        self.fit = [self.keeps_all] if self.batched else fit
        ratio = cfg.get("pruning_ratio")
        self.energy = (
            None if ratio is None else think.query_energy(query, key_valid, cfg.window_size)
        )
        self.scores = None  # per part, when computed ahead of the selection

    def observation(self, part) -> Observation:
        sample, first, budget = part
        if self.query is None:
            queries = self.key.new_empty(
                self.key[sample].shape[0], self.query_shape[0], 0, self.query_shape[1]
            )
        else:
            queries = self.query[sample, :, first:]
        memo = self.memo if self.batched else self.memo.setdefault(sample.start, {})
        return observation(
            self.plan,
            self.module,
            queries,
            self.key[sample, :, first:],
            self.value[sample, :, first:],
            self.key_valid[sample, first:],
            budget,
            self.kwargs,
            memo,
            rope=None if self.rope is None else self.rope.part(sample, first),
            hidden=None if self.hidden is None else self.hidden[sample, first:],
        )

    def score(self, raw=None) -> None:
        """Keep each part's selection scores [b, H, P] (``raw``: the method's scores of every
        position [b, H, n]); None for a part that keeps all it holds."""
        self.scores = []
        for part, fit in zip(self.parts, self.fit):
            if fit:
                self.scores.append(None)
                continue
            obs = self.observation(part)
            own = None if raw is None else raw[part[0], :, part[1] : part[1] + obs.prefix_len]
            self.scores.append(head_scores(obs, self.plan.cfg, own))

    def release(self) -> None:
        self.query = None
        self.memo = {}
        self.rope = None
        self.hidden = None

    def select(self, sizes=None) -> Kept:
        """The kept entries; ``sizes`` (per part, [b, Hkv] prefix entries per head) from a cross-layer budget."""
        hkv = self.key.shape[1]
        if self.keeps_all:
            return Kept(
                self.key,
                self.value,
                relative_positions(self.key_valid)[:, None].expand(-1, hkv, -1),
                self.key_valid,
            )
        kept = [self.select_part(i, sizes) for i in range(len(self.parts))]
        return kept[0] if self.batched else stack_samples(kept)

    def select_part(self, i: int, sizes=None) -> Kept:
        """Part ``i``'s kept entries: all it holds when it fits (unscored), else the config's
        selection."""
        cfg = self.plan.cfg
        obs = self.observation(self.parts[i])
        if self.fit[i]:
            return select(obs, cfg, fit=True)
        stepwise = [run for strategy, run in STEPWISE.items() if strategy.applies(cfg)]
        if stepwise:  # neither cross-layer sizes nor deferred scores here (their checks refuse)
            return stepwise[0](self.plan, self.module, obs, self.kwargs)
        return select(
            obs,
            cfg,
            self.plan.table,
            None if sizes is None else sizes[i],
            None if self.scores is None else self.scores[i],
        )

    def result(self, kept: Kept):
        """(the cache layer holding ``kept``, or None: keep the full one; the kept positions [b, H, kept])."""
        cfg = self.plan.cfg
        seen = self.seen
        if self.start:
            positions = torch.where(
                kept.positions >= 0, kept.positions + self.offset[:, None, None], -1
            )
            kept = self.rerotated(replace(kept, positions=positions))
            if self.keeps_all and not cfg.quant_method:
                return None, kept.positions  # the model's sliding-window layer holds exactly these
            if (
                kept.per_head and kept.kv_heads is None
            ):  # the masked layout: its mask also bounds the window
                return CompressedLayer(kept, seen=seen), kept.positions
            return cache_layer(kept, seen, cfg), kept.positions
        kept = self.rerotated(kept)
        ratio = cfg.get("pruning_ratio")
        channels = (
            None
            if ratio is None
            else think.kept_channels(kept.keys, kept.valid, self.energy, ratio)
        )
        layer = cache_layer(kept, seen, cfg, channels)
        if cfg.get("decode_interval"):
            b = self.key.shape[0]
            arm(
                layer,
                self.plan,
                [p[2] for p in self.parts] * (b if self.batched else 1),
                self.query,
                self.rope,
            )
        return layer, kept.positions

    def rerotated(self, kept: Kept) -> Kept:
        """``kept`` with its keys re-rotated to contiguous positions (``rerotate_keys``; as it is
        when off or when nothing is evicted)."""
        cfg = self.plan.cfg
        if not rerotate.applies(cfg) or self.keeps_all:
            return kept
        valid = kept.valid if kept.valid.dim() == 3 else kept.valid[:, None]
        valid = valid.expand_as(kept.positions)
        last = kept.positions.amax((1, 2))  # the newest prompt token: the window's last, kept
        first = (self.next_position - 1 - last)[:, None, None]  # RoPE position of the first token
        target = rerotate.packed_positions(valid, last, cfg.rerotate_keys) + first
        now = kept.positions.clamp_min(0) + first
        keys = rerotate.rerotated(kept.keys, valid, now, target, self.embed)
        return replace(kept, keys=keys)


@torch.no_grad()
def evict_layer(
    plan: LayerPlan,
    module,
    query,
    key,
    value,
    attention_mask,
    kwargs,
    memo: dict | None = None,
    pending: list | None = None,
    rope: Rope | None = None,
    hidden=None,
):
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
        the layer evicts; the result is then (None, None) until ``restkv.eviction.deferred.finish``.
    rope : Rope, optional
        The layer's RoPE over the prompt (``restkv.scoring.rope``), for scores that need the queries before RoPE.
    hidden : Tensor, optional
        [b, L, D] the layer's attention input, for a method that reads it (``Method.reads_hidden``).

    Returns
    -------
    (layer, positions)
        The cache layer to put in place of the layer's full one (None: keep the full one) and the kept
        positions [b, Hkv, kept] (from each sample's first real token, -1 on kept padding).

    On a sliding-window layer (``plan.window`` W) the entries scored and kept from are the last W - 1
    (``LayerPrefill``), and when nothing is evicted the model's own sliding-window layer stays. Scores are
    float32 whatever the caller's autocast, TF32 setting or default dtype (``float32_scoring``).
    """
    with float32_scoring(key.device.type):
        prefill = LayerPrefill(
            plan, module, query, key, value, attention_mask, kwargs, memo, rope, hidden
        )
        if plan.deferred and not prefill.keeps_all:
            if not plan.cfg.scorer.replays:
                prefill.score()
            prefill.release()
            pending.append(prefill)
            return None, None
        return prefill.result(prefill.select())


def key_valid_of(mask, batch: int, n: int, device) -> torch.Tensor:
    """[b, n] bool: which keys are real tokens, read off whatever mask the backend received at prefill."""
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # flash-attention padding mask
        return mask[:, -n:].bool().expand(batch, n)
    # each query sees its own key unless that key is padding (the last row would miss keys beyond a sliding window)
    row = mask[:, 0, -n:, :n].diagonal(dim1=-2, dim2=-1)
    row = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, n)
