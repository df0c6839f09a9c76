"""``prompt_block`` (kvpress's ``BlockPress``): the budget selected block by block, against a
float64 loop of the reference's loop on a model; the block rule, generate and the refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import capture, generate, prompt, tiny_model

import restkv
from restkv.config import CompressionConfig
from restkv.strategies.blocks import steps

B, W, L = 16, 4, 60


def snapkv_on(q, k, scaling, keys, g, h):
    """SnapKV's score (pooling none, window sum, GQA mean) of the entries ``keys`` (positions, in
    order) but the last W, observed by the queries at the last W of them, attending ``keys`` only.
    float64."""
    window = keys[-W:]
    score = {j: 0.0 for j in keys[:-W]}
    for r in range(g):
        for t in window:
            seen = [j for j in keys if j <= t]
            logits = torch.stack([q[h * g + r, t] @ k[h, j] for j in seen]) * scaling
            for a, j in zip(torch.softmax(logits, 0).tolist(), seen):
                if j in score:
                    score[j] += a / g
    return score


def block_loop(q, k, scaling, block):
    """kvpress's BlockPress loop: keep the first B, then for each block keep the best B of the kept
    and the block (the block's last W always: the window), blocks from B on by ``block``, a last one
    shorter than W joined to the one before. Per KV head, the kept positions."""
    starts = list(range(B, L, block))
    bounds = [[s, min(s + block, L)] for s in starts]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < W:
        last = bounds.pop()
        bounds[-1][1] = last[1]
    g = q.shape[0] // k.shape[0]
    out = []
    for h in range(k.shape[0]):
        kept = list(range(B))
        for start, stop in bounds:
            current = kept + list(range(start, stop))
            score = snapkv_on(q, k, scaling, current, g, h)
            best = sorted(score, key=lambda j: -score[j])[: B - W]
            kept = sorted(best) + current[-W:]
        out.append(set(kept))
    return out


@pytest.mark.parametrize("block", [8, 12, 6])
def test_each_block_is_selected_with_what_is_kept(block):
    model = tiny_model("llama", "sdpa")
    ids = prompt(L)
    captured = capture(model, ids)
    restkv.configure(
        model,
        method="snapkv",
        pooling="none",
        max_capacity_prompt=B,
        window_size=W,
        prompt_block=block,
    )
    model(ids)
    kept = restkv.kept_positions(model)
    for layer, (q, k, scaling) in captured.items():
        got = [{int(p) for p in row if p >= 0} for row in kept[layer][0]]
        assert got == block_loop(q[0], k[0], scaling, block)
    restkv.detach(model)


def test_the_blocks():
    assert steps(60, 16, 8, 4) == [(16, 24), (24, 32), (32, 40), (40, 48), (48, 56), (56, 60)]
    assert steps(60, 16, 6, 4)[-1] == (52, 60)  # 58..60 is shorter than the window: joined
    assert steps(16, 16, 8, 4) == []
    assert steps(18, 16, 8, 4) == [
        (16, 18)
    ]  # a first block follows the first B entries, contiguous


def test_blocks_change_the_kept_set_and_generate_runs():
    model = tiny_model("llama", "sdpa")
    ids = torch.cat([prompt(L, seed=1), prompt(L, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    restkv.configure(model, method="snapkv", max_capacity_prompt=B, window_size=W)
    plain = generate(model, ids, mask, n=5)
    alone = restkv.kept_positions(model)
    budgets = dict(max_capacity_prompt=B)
    for knobs in (
        budgets,
        dict(budgets, decode_interval=3),
        dict(budgets, head_budget="adakv"),
        dict(max_capacity_prompt_ratio=0.3),
    ):  # a budget per sample: each sample on its own
        restkv.configure(model, method="snapkv", window_size=W, prompt_block=8, **knobs)
        tokens, logits = generate(model, ids, mask, n=5)
        assert tokens.shape == plain[0].shape and torch.isfinite(logits).all()
        if knobs is budgets:
            assert any(not torch.equal(a, b) for a, b in zip(alone, restkv.kept_positions(model)))
    restkv.detach(model)


@pytest.mark.parametrize(
    "knobs,message",
    [
        (
            dict(prompt_block=3, window_size=4, max_capacity_prompt=16),
            "prompt_block must be >= window_size",
        ),
        (dict(prompt_block=64, layer_budget="global"), "prompt_block needs a budget per layer"),
        (dict(prompt_block=64, compose="l2norm"), "prompt_block and compose"),
        (dict(prompt_block=64, merge="pivot"), "prompt_block needs merge 'none'"),
    ],
)
def test_refusals(knobs, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(method="snapkv", **knobs)
