"""From scores to the kept entries: GQA reduction, per-head budgets, selection strategy (CriticalKV, ChunkKV),
top-B per KV head, set-level refinement, window, merging."""

from __future__ import annotations


import torch
from torch import Tensor

from ..cache import Kept
from ..config import CompressionConfig
from ..methods.expected_attention import keep_sinks
from ..scoring.observe import Observation, group_view
from ..strategies import RANKINGS
from ..strategies.budgets import fits, head_sizes
from ..strategies.merge import merge
from ..strategies.refine import top_set


def reduce_groups(scores: Tensor, hkv: int, how: str, hq: int | None = None) -> Tensor:
    """Per-query-head scores [b, Hq, P] -> per-KV-head [b, Hkv, P] (``none``: per query head [b, Hq, P]).

    ``mean`` / ``max`` over each GQA group. The scale-free variants first put every query head on one
    scale, so a head whose scores are larger (for ReST-KV: a larger ``||W_O^h||``) does not decide for
    its group: ``sum_norm`` divides each head's scores by their sum, ``rank`` replaces them by their
    rank / P; then the group mean. ``none`` keeps one set per query head (scores of a KV head, or shared
    by every head, are repeated for each query head of ``hq``), as the original: it expands the keys and
    values to the query heads before scoring and keeps one kept set per query head (g times the memory).
    """
    if how == "none":
        return (
            scores if scores.shape[1] == hq else scores.repeat_interleave(hq // scores.shape[1], 1)
        )
    if scores.shape[1] in (1, hkv):  # already per KV head, or shared by all heads
        return scores
    if how == "sum_norm":
        scores = scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    elif how == "rank":
        scores = scores.argsort(-1).argsort(-1).float() / scores.shape[-1]
    grouped = group_view(scores, hkv)
    return grouped.amax(2) if how == "max" else grouped.mean(2)


def raw_scores(obs: Observation, cfg: CompressionConfig) -> Tensor:
    """The method's scores [b, Hq or Hkv, P] (or [b, 1, P]), from ``obs.memo`` when already computed.

    The memo key is everything the score can read: its module, the window, the values of the knobs
    it declares (the only ones it is given) and, if it declares that it reads it, the layer's budget.
    Configs that differ only in how they select from the scores (budget, GQA reduction, per-head
    budgets, merging) share them: SnapKV's (also PyramidKV/AdaKV/HeadKV's) and H2O's are computed
    once for all budgets in sweep mode.
    """
    method = cfg.scorer
    knobs = cfg.score_knobs()
    key = (
        "scores",
        method.scorer,
        obs.window,
        knobs,
        obs.budget if method.uses_budget(knobs) else None,
    )
    if key not in obs.memo:
        obs.memo[key] = method.score(obs, knobs)
    return obs.memo[key]


def head_scores(obs: Observation, cfg: CompressionConfig, raw: Tensor | None = None) -> Tensor:
    """Scores of the prefix entries per KV head [b, Hkv, P] (per query head with ``gqa_agg="none"``);
    padding scores -inf, LU-KV's ``lukv_sink`` first tokens above every other entry. ``raw``: the
    method's scores [b, Hq or Hkv or 1, P] when computed elsewhere."""
    b = obs.keys.shape[0]
    hkv = obs.keys.shape[1]
    hq = obs.queries.shape[1]
    how = cfg.get("gqa_agg", "mean")
    raw = raw_scores(obs, cfg) if raw is None else raw
    s = reduce_groups(raw, hkv, how, hq).expand(b, hq if how == "none" else hkv, -1)
    if cfg.get("head_budget") == "lukv":
        s = keep_sinks(s, obs, obs.positions >= cfg.lukv_sink)
    return s.masked_fill(~obs.entry_valid[..., : obs.prefix_len], float("-inf"))


def ranking(obs: Observation, cfg: CompressionConfig, scores: Tensor, keep) -> Tensor:
    """What the top-k ranks [b, H, P]: the scores, turned by each ranking strategy that applies
    (``restkv.strategies.RANKINGS``: CriticalKV's two stages, ChunkKV's chunks (entropy-gated with
    ``low_entropy_chunk_length``), then set-level refinement)
    into its key. ``keep``: entries per head."""
    key = scores
    for strategy in RANKINGS:
        if strategy.applies(cfg):
            key = strategy.rank(obs, cfg, scores, key, keep)
    return key


def select(
    obs: Observation,
    cfg: CompressionConfig,
    table: Tensor | None = None,
    sizes: Tensor | None = None,
    scores: Tensor | None = None,
    width: int | None = None,
    fit: bool | None = None,
) -> Kept:
    """Keep the top prefix entries of each KV head, plus the window, in position order, then merge.

    Each head keeps ``budget - window`` prefix entries, or its own number with per-head budgets
    (``budgets.head_sizes``: AdaKV from the scores, HeadKV from the layer's ``table`` row [Hkv], LU-KV
    from its curve [99, Hkv] and each sample's real length; or
    ``sizes`` [b, Hkv] given, from a cross-layer budget). ``scores``: ``head_scores`` already
    computed. A selection strategy (``ranking``) may rank by another key than the scores; merging
    reads the scores. With ``gqa_agg="none"`` the heads are the query heads (GQA models), each with
    its own kept set. ``width``: with per-head budgets, the slots of every head (at least the
    longest head's kept entries plus the window; the slots past a head's entries invalid), which
    spares the host read of the longest. ``fit``: every head keeps all it holds (default: the n slots fit
    the budget; under tensor parallelism, the widest head over every rank's decides).
    """
    b, hkv, n, d = obs.keys.shape
    fit = fits(cfg, n, obs.budget) if fit is None else fit
    per_query_head = cfg.get("gqa_agg") == "none" and obs.queries.shape[1] != hkv and not fit
    if fit:
        idx = torch.arange(n, device=obs.keys.device).expand(b, hkv, n)
        keys = obs.keys
        values = obs.values
        sizes = None
    else:
        scores = head_scores(obs, cfg) if scores is None else scores
        base = obs.budget - obs.window
        if sizes is None:
            sizes = head_sizes(cfg, scores, base, table, obs.key_valid, obs.window)
        keep = base if sizes is None else sizes
        idx = _top_then_window(ranking(obs, cfg, scores, keep), keep, obs.window, width)
        keys, values = merge(
            cfg, obs, scores, idx, _gather(obs.keys, idx), _gather(obs.values, idx)
        )
    heads = idx.shape[1]
    positions = obs.positions[:, None].expand(b, heads, n).gather(2, idx)
    kv_heads = hkv if per_query_head else None
    if sizes is None:
        valid = obs.key_valid.gather(1, idx[:, 0])
        return Kept(
            keys,
            values,
            positions.masked_fill(~valid[:, None], -1),
            valid,
            kv_heads=kv_heads,
            index=idx,
        )
    in_head = torch.arange(idx.shape[-1], device=idx.device) < (sizes + obs.window)[..., None]
    valid = in_head & obs.entry_valid.expand(b, heads, n).gather(2, idx)
    return Kept(
        keys,
        values,
        positions.masked_fill(~valid, -1),
        valid,
        per_head=True,
        kv_heads=kv_heads,
        index=idx,
    )


def _top_then_window(scores: Tensor, keep, window: int, width: int | None = None) -> Tensor:
    """Indices [b, Hkv, K + window]: each head's top ``keep`` prefix entries in order, then the window.

    ``keep`` is an int, or [b, Hkv] per-head counts; then K + window is ``width`` if given, else the
    largest count's, and each head's row is [its entries, the window, filler] (filler repeats the
    last position and is marked invalid later).
    """
    b, hkv, P = scores.shape
    window_idx = torch.arange(P, P + window, device=scores.device)
    if isinstance(keep, int):
        top = scores.topk(keep, dim=-1).indices.sort(-1).values
        return torch.cat([top, window_idx.expand(b, hkv, -1)], -1)
    width = int(keep.max()) + window if width is None else width  # one host read per layer
    pos = torch.arange(P, device=scores.device).expand(b, hkv, P)
    top = torch.where(top_set(scores, keep), pos, P + window - 1).sort(-1).values
    top = torch.nn.functional.pad(top, (0, max(0, width - P)), value=P + window - 1)[..., :width]
    j = torch.arange(width, device=scores.device)
    in_window = (j >= keep[..., None]) & (j < keep[..., None] + window)
    return torch.where(in_window, P + j - keep[..., None], top)


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    """Entries ``idx`` [b, H, K] of x [b, Hkv, L, d] -> [b, H, K, d]; H a multiple of Hkv (query heads)."""
    b, hkv, n, d = x.shape
    heads = idx.shape[1]
    k = idx.shape[2]
    grouped = idx.reshape(b, hkv, (heads // hkv) * k)  # query heads of one KV head are contiguous
    if x.is_contiguous():  # whole rows of d copied at once: several times faster than gather
        rows = grouped + torch.arange(b * hkv, device=idx.device).view(b, hkv, 1) * n
        return x.view(b * hkv * n, d).index_select(0, rows.flatten()).view(b, heads, k, d)
    sample = torch.arange(b, device=idx.device)[:, None, None]
    head = torch.arange(hkv, device=idx.device)[None, :, None]
    return x[sample, head, grouped].view(b, heads, k, d)
