"""Tensor parallelism with a budget split across KV heads (``restkv.vllm.ranks``): each rank, seeing its own
heads and every rank's gathered scores, keeps what one device keeps of those heads."""

import numpy as np
import pytest
import torch
from helpers import on_ranks

from restkv.config import CompressionConfig
from restkv.strategies.budgets import shared_sizes
from restkv.strategies.head_budgets import headkv_budgets
from restkv.vllm import ranks as tp
from restkv.vllm import settings
from restkv.vllm.scoring import entry_scores, kept_entries, observation

HKV, GROUP, D, WINDOW, BUDGET, RANKS = 6, 2, 16, 8, 40, 3
SNAPKV = {"method": "snapkv", "max_capacity_prompt": BUDGET, "window_size": WINDOW}
CURVE = np.random.default_rng(3).uniform(0.2, 0.95, size=(99, 2, HKV))
CONFIGS = {
    "adakv": {**SNAPKV, "head_budget": "adakv"},
    "headkv": {**SNAPKV, "head_budget": "headkv"},
    "lukv": {**SNAPKV, "head_budget": "lukv"},
    # DefensiveKV's first stage would fill each head's share alike on flat random attention
    "defensivekv": {"method": "defensivekv", "max_capacity_prompt": BUDGET, "window_size": WINDOW, "first_stage_mass": 0.05},
    "tova": {"method": "tova", "max_capacity_prompt": BUDGET, "window_size": WINDOW},
    "snapkv-global": {**SNAPKV, "layer_budget": "global"},
    "layer-defensivekv": {
        "method": "layer_defensivekv", "value_norm": "l2", "max_capacity_prompt": BUDGET, "window_size": WINDOW,
        "first_stage_mass": 0.05,
    },
}


def config(name, tmp_path):
    knobs = dict(CONFIGS[name])
    if name == "lukv":
        np.save(tmp_path / "curve.npy", CURVE)
        knobs["lukv_curve"] = str(tmp_path / "curve.npy")
    return CompressionConfig.with_defaults(knobs)


def table(name, layer):
    if name == "headkv":
        importance = torch.from_numpy(np.random.default_rng(4).gamma(0.5, size=(2, HKV)))
        return headkv_budgets(importance, BUDGET - WINDOW, 1.01)[layer]
    if name == "lukv":
        return torch.from_numpy(CURVE[:, layer])
    return None


def layer(seed, lengths=None, n=120):
    """One layer's queries [r, Hq, d], and its entries [W, Hkv, d] laid out per head where ``lengths``
    [Hkv] gives each head's count (older entries first, the window in the last slots; ``head_valid``)."""
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(WINDOW, HKV * GROUP, D, generator=g, dtype=torch.float64)
    width = n if lengths is None else max(lengths)
    keys, values = (torch.randn(width, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    if lengths is None:
        return queries, keys, values, None
    j = torch.arange(width)[None]
    n_h = torch.tensor(lengths)[:, None]
    held = (j < n_h - WINDOW) | (j >= width - WINDOW)
    return queries, keys, values, held[None]


def rank_view(ranks, queries, keys, values, held):
    """A rank's heads of a layer, laid out as the worker lays them out: at the widest head's width over
    every rank (``Ranks.most`` of each rank's own widest)."""
    r = ranks.rank
    h = slice(r * HKV // RANKS, (r + 1) * HKV // RANKS)
    q = queries[:, r * HKV * GROUP // RANKS : (r + 1) * HKV * GROUP // RANKS]
    if held is None:
        return q, keys[:, h], values[:, h], None
    mine = held[:, h]
    (width,) = ranks.most([int(mine.sum(-1).max())])
    columns = torch.cat([torch.arange(width - WINDOW), torch.arange(keys.shape[0] - WINDOW, keys.shape[0])])
    return q, keys[columns][:, h], values[columns][:, h], mine[..., columns]


W_O = torch.randn(32, HKV * GROUP * D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def observe(cfg, q, k, v, held, number=0, rank=None, gather=None):
    """The observation of one device's heads, or of ``rank``'s (W_O's columns of its query heads, as a
    row-parallel o_proj holds them; ``gather`` its ranks' gather)."""
    width = HKV * GROUP * D // RANKS
    weight = W_O if rank is None else W_O[:, rank * width : (rank + 1) * width]
    return observation(
        cfg, q, k, v, BUDGET, D**-0.5, None, number, 2, lambda: weight, head_valid=held, gather_heads=gather
    )


def each_heads_kept(kept):
    """Every head's kept keys in cache order [Hkv] of [n_h, d]."""
    return [kept.keys[0, h][kept.valid[0, h] if kept.valid.dim() == 3 else kept.valid[0]] for h in range(kept.keys.shape[1])]


@pytest.mark.parametrize("lengths", [None, [90, 30, 12, 60, 45, 20]], ids=["prefill", "per-head-layout"])
@pytest.mark.parametrize("name", ["adakv", "headkv", "lukv", "defensivekv", "tova"])
def test_each_rank_keeps_its_heads_part_of_one_devices_selection(name, lengths, tmp_path):
    """Every rank's heads keep, entry for entry, what one device keeps of them (DefensiveKV's and TOVA's
    scores read every head, ``Observation.every_head``; a per-head layout re-evicts while decoding, each
    rank's widest head holding another count: laid out at the widest over every rank)."""
    cfg = config(name, tmp_path)
    if lengths is not None and not settings.per_head(cfg):
        pytest.skip("its heads never hold their own pages")
    whole = layer(1, lengths)
    expected = each_heads_kept(kept_entries(observe(cfg, *whole), cfg, table=table(name, 0)))

    def rank(ranks):
        obs = observe(cfg, *rank_view(ranks, *whole), rank=ranks.rank, gather=ranks.gather)
        if not settings.sized_across_heads(cfg):  # as the worker: its own selection
            return each_heads_kept(kept_entries(obs, cfg))
        scores = entry_scores(obs, cfg)
        fit, sizes = tp.layer_sizes(ranks, obs, cfg, scores, table(name, 0))
        return each_heads_kept(kept_entries(obs, cfg, sizes=sizes, scores=scores, fit=fit))

    kept = [head for heads in on_ranks(RANKS, rank) for head in heads]
    assert [len(k) for k in kept] == [len(k) for k in expected]
    assert len({len(k) for k in kept}) > 1 or name == "tova", "every head kept the same count"
    for mine, theirs in zip(kept, expected):
        assert torch.equal(mine, theirs)


def test_a_layer_whose_widest_head_fits_keeps_all_on_every_rank(tmp_path):
    """The ranks' heads 4 and 5 hold fewer than the layer's widest; the layer fits its budget, so every
    rank keeps all (none gathers the scores)."""
    cfg = config("adakv", tmp_path)
    whole = layer(2, [BUDGET, 20, 12, 30, BUDGET - 1, 9])

    def rank(ranks):
        obs = observe(cfg, *rank_view(ranks, *whole))
        return tp.layer_sizes(ranks, obs, cfg, entry_scores(obs, cfg))

    assert on_ranks(RANKS, rank) == [(True, None)] * RANKS


@pytest.mark.parametrize("name", ["snapkv-global", "layer-defensivekv"])
def test_a_budget_shared_across_layers_splits_over_every_ranks_heads(name, tmp_path):
    """Two layers of different lengths, one top-k over every layer's and head's scores: each rank's heads get
    one device's counts."""
    cfg = config(name, tmp_path)
    layers = [layer(10 + i, n=100 + 20 * i) for i in range(2)]
    scores = [entry_scores(observe(cfg, *x, number=i), cfg) for i, x in enumerate(layers)]
    width = max(s.shape[-1] for s in scores)
    expected = shared_sizes(cfg, [tp.padded(s, width) for s in scores], BUDGET)

    def rank(ranks):
        r = ranks.rank
        views = [observe(cfg, *rank_view(ranks, *x), number=i, rank=r, gather=ranks.gather) for i, x in enumerate(layers)]
        return tp.layers_sizes(ranks, cfg, [entry_scores(o, cfg) for o in views], BUDGET)

    for r, (fit, sizes) in enumerate(on_ranks(RANKS, rank)):
        assert fit == [False, False]
        h = slice(r * HKV // RANKS, (r + 1) * HKV // RANKS)
        for got, want in zip(sizes, expected):
            assert torch.equal(got, want[:, h])
