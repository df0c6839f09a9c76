"""Tensor parallelism with a budget split across KV heads (``restkv.vllm.ranks``): each rank, seeing its own
heads and every rank's gathered scores, keeps what one device keeps of those heads."""

import numpy as np
import pytest
import torch

from restkv.config import CompressionConfig
from restkv.strategies.budgets import shared_sizes
from restkv.strategies.head_budgets import headkv_budgets
from restkv.vllm import ranks as tp
from restkv.vllm.scoring import entry_scores, kept_entries, observation

HKV, GROUP, D, WINDOW, BUDGET, RANKS = 6, 2, 16, 8, 40, 3
SNAPKV = {"method": "snapkv", "max_capacity_prompt": BUDGET, "window_size": WINDOW}
CURVE = np.random.default_rng(3).uniform(0.2, 0.95, size=(99, 2, HKV))
CONFIGS = {
    "adakv": {**SNAPKV, "head_budget": "adakv"},
    "headkv": {**SNAPKV, "head_budget": "headkv"},
    "lukv": {**SNAPKV, "head_budget": "lukv"},
    "snapkv-global": {**SNAPKV, "layer_budget": "global"},
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


def rank_view(r, queries, keys, values, held):
    """Rank r's heads of a layer, laid out at its own widest head's width."""
    h = slice(r * HKV // RANKS, (r + 1) * HKV // RANKS)
    q = queries[:, r * HKV * GROUP // RANKS : (r + 1) * HKV * GROUP // RANKS]
    if held is None:
        return q, keys[:, h], values[:, h], None
    mine = held[:, h]
    width = int(mine.sum(-1).max())
    columns = torch.cat([torch.arange(width - WINDOW), torch.arange(keys.shape[0] - WINDOW, keys.shape[0])])
    return q, keys[columns][:, h], values[columns][:, h], mine[..., columns]


W_O = torch.randn(32, HKV * GROUP * D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def observe(cfg, q, k, v, held, number=0, rank=None):
    """The observation of one device's heads, or of ``rank``'s (W_O's columns of its query heads, as a
    row-parallel o_proj holds them)."""
    width = HKV * GROUP * D // RANKS
    weight = W_O if rank is None else W_O[:, rank * width : (rank + 1) * width]
    return observation(cfg, q, k, v, BUDGET, D**-0.5, None, number, 2, lambda: weight, head_valid=held)


def each_heads_kept(kept):
    """Every head's kept keys in cache order [Hkv] of [n_h, d]."""
    return [kept.keys[0, h][kept.valid[0, h] if kept.valid.dim() == 3 else kept.valid[0]] for h in range(kept.keys.shape[1])]


def fake_ranks(r, gathered, widest):
    """Rank r whose collectives return what every rank gave (``gathered``: each rank's tensor before
    padding, or a list per call; ``widest``: the widths' maxima)."""
    calls = iter(widest)

    def gather(x):
        parts = [x if i == r else tp.padded(gathered[i], x.shape[-1]) for i in range(RANKS)]
        return torch.cat(parts, 1)

    return tp.Ranks(r, RANKS, gather, lambda values: next(calls))


@pytest.mark.parametrize("lengths", [None, [90, 30, 12, 60, 45, 20]], ids=["prefill", "per-head-layout"])
@pytest.mark.parametrize("name", ["adakv", "headkv", "lukv"])
def test_each_rank_keeps_its_heads_part_of_one_devices_selection(name, lengths, tmp_path):
    cfg = config(name, tmp_path)
    whole = layer(1, lengths)
    one = kept_entries(observe(cfg, *whole), cfg, table=table(name, 0))
    views = [rank_view(r, *whole) for r in range(RANKS)]
    obs = [observe(cfg, *view) for view in views]
    scores = [entry_scores(o, cfg) for o in obs]
    widest = [[max(o.prefix_len for o in obs)]]
    kept = []
    for r in range(RANKS):
        fit, sizes = tp.layer_sizes(fake_ranks(r, scores, widest), obs[r], cfg, scores[r], table(name, 0))
        kept += each_heads_kept(kept_entries(obs[r], cfg, sizes=sizes, scores=scores[r], fit=fit))
    expected = each_heads_kept(one)
    assert [len(k) for k in kept] == [len(k) for k in expected]
    for mine, theirs in zip(kept, expected):
        assert torch.equal(mine, theirs)


def test_a_layer_whose_widest_head_fits_keeps_all_on_every_rank(tmp_path):
    cfg = config("adakv", tmp_path)
    whole = layer(2, [BUDGET, 20, 12, 30, BUDGET - 1, 9])
    obs = observe(cfg, *rank_view(2, *whole))  # the rank of heads 4 and 5, narrower than the layer
    scores = entry_scores(obs, cfg)
    fit, sizes = tp.layer_sizes(fake_ranks(2, [scores] * RANKS, [[BUDGET - WINDOW]]), obs, cfg, scores)
    assert fit and sizes is None


def test_a_budget_shared_across_layers_splits_over_every_ranks_heads(tmp_path):
    cfg = config("snapkv-global", tmp_path)

    layers = [layer(10 + i, n=100 + 20 * i) for i in range(2)]  # two layers, prompts held alike per layer
    obs = [observe(cfg, *x, number=i) for i, x in enumerate(layers)]
    scores = [entry_scores(o, cfg) for o in obs]
    width = max(s.shape[-1] for s in scores)
    expected = shared_sizes(cfg, [tp.padded(s, width) for s in scores], BUDGET)
    for r in range(RANKS):
        views = [observe(cfg, *rank_view(r, *x), number=i, rank=r) for i, x in enumerate(layers)]
        mine = [entry_scores(o, cfg) for o in views]
        theirs = [
            torch.cat([tp.padded(entry_scores(observe(cfg, *rank_view(i, *x), number=j, rank=i), cfg), width) for j, x in enumerate(layers)])
            for i in range(RANKS)
        ]
        ranks = fake_ranks(r, theirs, [[s.shape[-1] for s in scores]])
        fit, sizes = tp.layers_sizes(ranks, cfg, mine, BUDGET)
        assert fit == [False, False]
        h = slice(r * HKV // RANKS, (r + 1) * HKV // RANKS)
        for got, want in zip(sizes, expected):
            assert torch.equal(got, want[:, h])
