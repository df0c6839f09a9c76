"""KVCompose: attention from a second reading of the context; layers' budgets from composite tokens.

Paper: "KVCompose: Efficient Structured KV Cache Compression with Composite Tokens" (Akulov et al.,
2025), https://arxiv.org/abs/2509.05165; code: kvpress ``KVComposePress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/kvcompose_press.py``).

After the prefill the model reads its prompt a second time (one pass, positions L..2L-1, after the
full cache, which it leaves as it was). An entry's score at a query head is the largest
(``agg_task="max"``) or mean attention it receives from that pass's queries; the heads of a GQA
group are averaged (``agg_group``), and the mean over the layer's KV heads is added to every head
(``add_mean_across_heads``).

Composite tokens (``structured=True``): each KV head's scores are sorted, the i-th composite token
of a layer is the i-th best entry of every head, scored by the mean (``agg_head``) of those heads'
i-th scores; the first layer's composite scores are the largest over the layers; one top-k over
every layer's composite tokens gives each layer its count, and each head of the layer keeps that
many of its own best entries (every head of a layer keeps as many). Here this is
``layer_budget="global"`` (the registration's default) with the reference's count of the entries
each layer keeps (``global_sizes``, replacing the plain top-k over every layer, head and entry).
``structured=False`` is the reference's unstructured variant: the plain global top-k.
``keep_token_lower_bound``: every layer keeps at least that many entries per head.

Cost: the L prompt tokens read again, each attending over the prompt and the pass's tokens before
it. They are read in forwards of ``PASS_CHUNK`` tokens, so no forward builds an [L, 2L] mask; the
pass's own keys and values are held between them (one more copy of the model's K+V at the end, as
the reference's cache of about 2L). Each forward's attention is computed a block of queries at a
time (``Observation.attention_blocks``: about the layer's K+V in float32), so memory stays linear in
L.

Differences: float32 scores (the reference's eager attention is in the model dtype); the observation
window is always kept apart (the reference keeps no window: ``window_size=1`` comes closest) and the
composite tokens are formed over the evictable entries; ``add_v_norm`` (the reference's default
False) is not provided; padding is supported (the reference: batch 1); kvpress 0.5.5 floors each
layer's count at ``max(1, keep_token_lower_bound)`` composite tokens beyond its top-k (here every
head keeps its window). With ``layer_budget="uniform"`` every head of every layer keeps B (no
composite tokens).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch
from ..scoring.observe import attention_received, group_view

PASS_CHUNK = 512  # the pass's tokens per forward (restkv.eviction.deferred.replay_scores)

KNOBS = (
    Knob(
        "structured",
        True,
        "composite tokens: every head of a layer keeps as many entries, "
        "layers' counts from one top-k over their composite scores (False: one top-k over every "
        "head's entries)",
    ),
    Knob(
        "agg_task",
        "max",
        "reduction over the second reading's queries of the attention an entry receives",
        choices=("max", "mean"),
    ),
    Knob(
        "agg_group",
        "mean",
        "reduction over the query heads of a GQA group",
        choices=("mean", "max"),
    ),
    Knob(
        "agg_head",
        "mean",
        "reduction over a layer's KV heads of their i-th best scores (a composite token)",
        choices=("mean", "max"),
        when={"structured": (True,)},
    ),
    Knob(
        "add_mean_across_heads",
        True,
        "add the mean over the layer's KV heads to each head's scores",
    ),
    Knob(
        "keep_token_lower_bound",
        0,
        "entries every layer keeps per head at least",
        rule=">= 0",
    ),
)


def check(cfg):
    if cfg.get("decode_interval"):
        raise ValueError(
            "decode_interval is not supported by kvcompose (its scores come from "
            "a pass after the prefill)"
        )


def passes(context_ids: "torch.Tensor", cfg, model) -> tuple[int, list]:
    """One pass: the prompt ``context_ids`` [L] read again, scoring every position ->
    (0 sinks, [(0, L, context_ids)])."""
    return 0, [(0, context_ids.shape[0], context_ids)]


def score(obs, cfg):
    """Attention of the pass's queries over the prompt's entries, reduced over the queries and the
    group, plus the mean over the KV heads -> [b, Hkv, P]."""
    return finish(query_statistic(obs, cfg), obs.queries.shape[2], obs.keys.shape[1], cfg)


def query_statistic(obs, cfg):
    """The largest (``agg_task="max"``) or summed attention each entry before the queries receives
    from them -> [b, Hq, P]; one forward's part of a pass read in several (``PASS_CHUNK``)."""
    blocks = obs.attention_blocks(obs.queries.shape[2])  # about the layer's K+V each
    return attention_received(blocks, obs.prefix_len, "max" if cfg.agg_task == "max" else "sum")


def merge(a, b, cfg):
    """Two forwards' ``query_statistic`` of one pass [b, Hq, P] -> theirs together."""
    return torch.maximum(a, b) if cfg.agg_task == "max" else a + b


def finish(statistic, rows: int, hkv: int, cfg):
    """A pass's ``query_statistic`` [b, Hq, P] over its ``rows`` queries -> scores [b, Hkv, P]:
    the mean over the queries (``agg_task="mean"``), the group's reduction, the heads' mean added."""
    per_query = statistic / rows if cfg.agg_task == "mean" else statistic
    grouped = group_view(per_query, hkv)
    s = grouped.amax(2) if cfg.agg_group == "max" else grouped.mean(2)
    return s + s.mean(1, keepdim=True) if cfg.add_mean_across_heads else s


def global_sizes(scores: list, total: int, cfg, top_k) -> list:
    """Prefix entries each (layer, KV head) keeps [b, Hkv] per layer, from the layers' scores
    [b, Hkv, P] (-inf on padding) and the ``total`` shared (window excluded), as the reference
    counts them.

    ``structured``: one top-k of ``total // Hkv`` over every layer's composite tokens (its heads'
    i-th best scores reduced by ``agg_head``; the first layer's the largest over the layers); every
    head of a layer keeps the layer's count. Else one top-k over every head's entries.
    ``keep_token_lower_bound``: the first composite tokens (each head's best entries) first. ``top_k``:
    the plain split (``restkv.strategies.budgets.global_sizes``), given by the eviction step.
    """
    ranked = [s.sort(-1, descending=True).values for s in scores]  # [b, Hkv, P], -inf last
    first = cfg.keep_token_lower_bound
    if first:
        ranked = [torch.cat([r[..., :first] + 1e9, r[..., first:]], -1) for r in ranked]
    if not cfg.structured:
        return top_k(ranked, total)
    b, hkv, P = ranked[0].shape
    pick = torch.amax if cfg.agg_head == "max" else torch.mean
    composite = torch.stack([pick(r, 1) for r in ranked], 1)  # [b, layers, P]
    composite[:, 0] = composite.amax(1)  # the reference: "ensures first layer is the largest"
    top = composite.reshape(b, -1).topk(min(total // hkv, composite[0].numel()), dim=-1)
    counts = torch.zeros(b, len(scores), dtype=torch.long, device=composite.device)
    counts.scatter_add_(1, top.indices // P, torch.isfinite(top.values).long())
    return [c[:, None].expand(b, hkv) for c in counts.unbind(1)]
