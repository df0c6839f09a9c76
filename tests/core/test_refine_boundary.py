"""Refinement with candidates at the top-B boundary (``refine_candidates="boundary"``): the pooled entries'
terms computed alone give the exact swap errors of a float64 loop, one round only swaps entries of the
boundary pools, and the refined set lowers the window queries' error measured by the float64 loop."""

from __future__ import annotations

import pytest
import torch
from test_methods_2026 import case
from test_refine import direct_error, kept_mask, random_layer, window_error_loop

from restkv.config import CompressionConfig
from restkv.eviction.select import head_scores, select
from restkv.scoring.output_error import group_terms, output_change, swap_errors_at
from restkv.strategies.refine import swap_search, top_set


def test_pooled_terms_give_the_exact_swap_errors():
    attention, values, w_o = random_layer(21, n=36)
    stored = values.to(torch.bfloat16)  # the pooled entries' values are converted after the gather
    values = stored.float()
    prefix = 28
    b, hkv = values.shape[:2]
    scores = torch.rand(b, hkv, prefix, generator=torch.Generator().manual_seed(22))
    keep = top_set(scores, 10)
    state = output_change(attention, values, keep, w_o)
    removals = scores.masked_fill(~keep, float("inf")).topk(4, largest=False).indices
    additions = scores.masked_fill(keep, float("-inf")).topk(5).indices
    layer = group_terms(stored, w_o, prefix)
    assert layer[3] is None  # no per-entry term over the whole prefix
    pairs = swap_errors_at(attention, layer, state, removals, additions)
    for s in range(b):
        for k in range(hkv):
            for i in range(4):
                for j in range(5):
                    other = keep.clone()
                    other[s, k, removals[s, k, i]] = False
                    other[s, k, additions[s, k, j]] = True
                    want = direct_error(attention, values, other, w_o)[s]
                    assert pairs[s, k, i, j].item() == pytest.approx(want.item(), rel=1e-5)


def test_one_round_swaps_only_entries_at_the_boundary():
    attention, values, w_o = random_layer(23, n=40)
    prefix = 32
    pool = 3
    b, hkv = values.shape[:2]
    scores = torch.rand(b, hkv, prefix, generator=torch.Generator().manual_seed(24))
    start = top_set(scores, 12)
    layer = group_terms(values, w_o, prefix)
    keep, error, swaps = swap_search(attention, values, start, scores, w_o, rounds=1, pool=pool,
                                     batch=pool, pool_by="score", layer=layer, stop=False)
    assert (swaps > 0).all() and torch.equal(keep.sum(-1), start.sum(-1))
    lowest_kept = scores.masked_fill(~start, float("inf")).topk(pool, largest=False).indices
    highest_evicted = scores.masked_fill(start, float("-inf")).topk(pool).indices
    out_pool = torch.zeros_like(start).scatter_(-1, lowest_kept, True)
    in_pool = torch.zeros_like(start).scatter_(-1, highest_evicted, True)
    assert not ((start & ~keep) & ~out_pool).any()  # evicted: only the lowest-ranked kept
    assert not ((keep & ~start) & ~in_pool).any()  # kept: only the highest-ranked evicted
    final = direct_error(attention, values, keep, w_o)
    assert (final < direct_error(attention, values, start, w_o)).all()
    torch.testing.assert_close(error.double().mean(-1), final, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("knobs", [dict(method="restkv"), dict(method="snapkv"),
                                   dict(method="adakv", floor=0.0), dict(method="snapkv", gqa_agg="none")])
def test_boundary_refinement_lowers_the_window_error_by_the_loop(knobs):
    obs, *_ = case(n=30, pad=(0, 6), window=4, budget=12)
    cfg = CompressionConfig(max_capacity_prompt=obs.budget, window_size=obs.window, **knobs)
    before = kept_mask(obs, select(obs, cfg))
    refined = CompressionConfig(**{**cfg, "refine_rounds": 1, "refine_pool": 4,
                                   "refine_candidates": "boundary"})
    after = kept_mask(obs, select(obs, refined))
    assert torch.equal(after.sum(-1), before.sum(-1))
    assert not (after & ~obs.key_valid[:, None, : obs.prefix_len]).any()  # never padding
    e_before = window_error_loop(obs, before)
    e_after = window_error_loop(obs, after)
    assert (e_after <= e_before * (1 + 1e-6)).all() and (e_after < e_before * 0.999).any()
    key = head_scores(obs, cfg)  # the ranking (maxpool ties: compared by value, not by rank)
    fourth_lowest_kept = key.masked_fill(~before, float("inf")).topk(4, largest=False).values[..., -1:]
    fourth_highest_evicted = key.masked_fill(before, float("-inf")).topk(4).values[..., -1:]
    assert not (before & ~after & (key > fourth_lowest_kept)).any()  # evicted: the lowest-ranked kept
    assert not (after & ~before & (key < fourth_highest_evicted)).any()  # kept: the highest evicted


def test_refine_candidates_needs_rounds():
    with pytest.raises(ValueError, match="refine_candidates is read only when refine_rounds > 0") as e:
        CompressionConfig(method="restkv", refine_candidates="boundary")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="refine_candidates"):
        CompressionConfig(method="restkv", refine_rounds=1, refine_candidates="edge")
