"""One request's eviction in one layer, from what vLLM's attention backend holds (no vLLM import).

The observation and selection are restkv's own (``restkv.scoring.observe.Observation``,
``restkv.eviction.select.select``), laid out as restkv's eviction while decoding lays out a layer:
the entries held in cache order, the most recent queries as the window's. So the kept entries are
those ``restkv.configure`` keeps for the same prompt, layer and config, at prefill and while
decoding.
"""

from __future__ import annotations

import torch

from ..cache import Kept
from ..config import CompressionConfig
from ..eviction.select import head_scores, select
from ..strategies.budgets import fits
from ..methods import h2o
from ..scoring.observe import Observation, wo_factor
from ..scoring.output_error import wo_gram
from ..scoring.precision import float32_scoring


def observation(
    cfg: CompressionConfig,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    budget: int,
    scale: float,
    softcap: float | None,
    layer: int,
    num_layers: int,
    o_proj_weight=None,
    factor=None,
    window: int | None = None,
    head_valid: torch.Tensor | None = None,
    gather_heads=None,
) -> Observation:
    """What the scorer sees of one request in one layer.

    Parameters
    ----------
    queries, keys, values : Tensor
        [r, Hq, d] the queries of the last r positions held, [H, Hkv, d] the entries held (after
        RoPE), in cache order.
    budget
        Entries kept per KV head, window included.
    o_proj_weight, factor : callable, optional
        Return the layer's o_proj weight [hidden, Hq d] and its W_O factor R [Hq, d, d]
        (``restkv.scoring.observe.wo_factor``; ReST-KV's W_O terms), called only if a score reads
        them; the factor defaults to one computed from the weight.
    window
        The observation window (default ``cfg.window_size``; 0 scores every entry held).
    head_valid : Tensor, optional
        [1, Hkv, H] which slots each head holds, where heads hold different entries (each head's older
        entries first, its newest ``window`` in the last slots: ``restkv.eviction.reselect.relayout``), H
        the layer's widest head's count (over every rank: its slots are all held, so is each slot by some head).
    gather_heads : callable, optional
        Under tensor parallelism, [b, h, ...] of this rank's heads -> every rank's (``ranks.Ranks.gather``),
        for a score that reads every head (``Observation.every_head``).
    """
    n = keys.shape[0]
    hq, d = queries.shape[1], queries.shape[2]
    weight = o_proj_weight
    return Observation(
        queries=queries.transpose(0, 1)[None],
        keys=keys.transpose(0, 1)[None],
        values=values.transpose(0, 1)[None],
        key_valid=torch.ones(1, n, dtype=torch.bool, device=keys.device),  # each slot some head's (the widest's)
        head_valid=head_valid,
        window=cfg.window_size if window is None else window,
        budget=budget,
        scaling=scale,
        softcap=softcap or None,
        layer=layer,
        num_layers=num_layers,
        wo_factor=factor or (None if weight is None else (lambda: wo_factor(weight(), hq))),
        wo_weight=weight,
        wo_gram=None if weight is None else (lambda heads: wo_gram(weight(), heads, d)),
        gather_heads=gather_heads,
    )


@torch.no_grad()
def entry_scores(obs: Observation, cfg: CompressionConfig, summed: torch.Tensor | None = None) -> torch.Tensor:
    """The selection's scores of the prefix entries held [1, Hkv, P] float32 (``head_scores``).
    ``summed`` [Hq or Hkv, H]: a ``SUMMED`` method's score of every entry held, added up over the
    prompt's chunks (``chunk_score``)."""
    with float32_scoring(obs.keys.device.type):
        return head_scores(obs, cfg, None if summed is None else summed[None, :, : obs.prefix_len])


@torch.no_grad()
def kept_entries(
    obs: Observation,
    cfg: CompressionConfig,
    summed: torch.Tensor | None = None,
    table=None,
    sizes=None,
    scores=None,
    fit: bool | None = None,
) -> Kept:
    """What one request keeps in one layer: keys / values [1, Hkv, B, d], positions [1, Hkv, B]
    (indices among the entries held). ``summed``: as ``entry_scores``; ``table`` [Hkv]: HeadKV's counts
    for the layer (``settings.head_table``); ``sizes`` [1, Hkv] each head's prefix entries and
    ``scores`` its ``entry_scores``, where the heads' split is decided elsewhere (a budget shared across
    layers, or across tensor-parallel ranks: ``ranks.layer_sizes``); ``fit``: every head keeps all it holds
    (default: its slots fit the budget)."""
    fit = fits(cfg, obs.keys.shape[2], obs.budget) if fit is None else fit
    if obs.head_valid is not None and fit:  # every head keeps all it holds
        valid = obs.head_valid
        return Kept(obs.keys, obs.values, obs.positions[:, None].masked_fill(~valid, -1), valid, per_head=True)
    if scores is None and summed is not None:
        scores = entry_scores(obs, cfg, summed)
    with float32_scoring(obs.keys.device.type):
        return select(obs, cfg, table=table, sizes=sizes, scores=scores, fit=fit)


@torch.no_grad()
def chunk_score(
    obs: Observation, cfg: CompressionConfig, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """A ``SUMMED`` method's score of every entry held from the queries ``obs`` holds (a chunk of
    the prompt; ``obs.window`` 0) -> [Hq or Hkv, H] float32. H2O's sums by ``h2o.column_sums``, one
    product per block of queries over the keys they see: from ``lse`` [Hq, r], each query's
    log-sum-exp as the attention backend returned it (one exponential, no second softmax), else with
    one softmax per block in place."""
    with float32_scoring(obs.keys.device.type):
        if cfg.scorer.module is h2o:
            return h2o.column_sums(obs, None if lse is None else lse.float()[None])[0]
        return cfg.scorer.score(obs, cfg.score_knobs())[0]


def slot_rows(kept: Kept) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept keys and values as vLLM writes tokens: [B, Hkv, d] each, row j holding every head's
    j-th entry."""
    return kept.keys[0].transpose(0, 1).contiguous(), kept.values[0].transpose(0, 1).contiguous()
