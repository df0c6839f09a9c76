"""``prompt_chunk`` (kvpress's ``ChunkPress``): each chunk of the prefix keeps its share of the
budget, against float64 loops of the definition, on hand-made observations and on a model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import capture, prompt, tiny_model
from test_methods_2026 import case
from test_strategies_2026 import kept_sets

import restkv
from restkv.config import CompressionConfig
from restkv.eviction.select import head_scores
from restkv.strategies.budgets import head_sizes


def shares_loop(chunk_counts, keep):
    """Each chunk's share of ``keep``: floor(C_c keep / N) - floor(C_(c-1) keep / N), exact
    rationals."""
    total = sum(chunk_counts)
    out, before, through = [], 0, 0
    for n in chunk_counts:
        through += n
        upto = math.floor(through * keep / total)
        out.append(upto - before)
        before = upto
    return out


def uniform_loops(scores, positions, size, keeps):
    """Kept index sets per (sample, head): in each chunk of ``size`` positions, its share of the
    head's keep, the best by the head's score (float64)."""
    out = []
    for i in range(scores.shape[0]):
        chunks = {}
        for j, p in enumerate(positions[i].tolist()):
            if p >= 0:
                chunks.setdefault(p // size, []).append(j)
        ids = sorted(chunks)
        row = []
        for h in range(scores.shape[1]):
            shares = shares_loop([len(chunks[c]) for c in ids], keeps[i][h])
            kept = set()
            for c, share in zip(ids, shares):
                best = sorted(chunks[c], key=lambda j: (-float(scores[i, h, j].double()), j))
                kept |= set(best[:share])
            row.append(kept)
        out.append(row)
    return out


@pytest.mark.parametrize(
    "size,budget,pad", [(5, 14, (0, 3)), (4, 12, (0, 0)), (7, 20, (2, 6)), (32, 10, (0, 1))]
)
@pytest.mark.parametrize("method", ["snapkv", "l2norm"])
def test_each_chunk_keeps_its_share_as_loops_do(size, budget, pad, method):
    obs, *_ = case(n=36, pad=pad, window=4, budget=budget, seed=5)
    got, cfg = kept_sets(obs, method=method, prompt_chunk=size)
    keeps = [[budget - 4] * obs.keys.shape[1]] * obs.keys.shape[0]
    assert got == uniform_loops(
        head_scores(obs, cfg), obs.positions[:, : obs.prefix_len], size, keeps
    )


def test_per_head_budgets_are_shared_by_chunks_head_by_head():
    obs, *_ = case(n=36, pad=(0, 3), window=4, budget=16, seed=2)
    got, cfg = kept_sets(obs, method="adakv", prompt_chunk=6)
    scores = head_scores(obs, cfg)
    sizes = head_sizes(cfg, scores, 12).tolist()
    assert len({tuple(s) for s in sizes}) > 1 or len(set(sizes[0])) > 1, (
        "heads keep different counts"
    )
    assert got == uniform_loops(scores, obs.positions[:, : obs.prefix_len], 6, sizes)


def test_a_model_keeps_each_chunks_smallest_key_norms():
    """On a model: L2Norm with prompt_chunk keeps, per layer and head, each chunk's share of the
    smallest key norms (float64 keys of a plain forward)."""
    model = tiny_model("llama", "sdpa")
    ids = prompt(70)
    budget, window, size = 30, 4, 16
    keys = {layer: k for layer, (_, k, _) in capture(model, ids).items()}
    restkv.configure(
        model, method="l2norm", max_capacity_prompt=budget, window_size=window, prompt_chunk=size
    )
    model(ids)
    kept = restkv.kept_positions(model)
    P = 70 - window
    positions = torch.arange(P)[None]
    for layer, k in keys.items():
        norms = -k[:, :, :P].norm(dim=-1)
        ref = uniform_loops(norms, positions, size, [[budget - window] * k.shape[1]])[0]
        got = [{int(p) for p in row if 0 <= p < P} for row in kept[layer][0]]
        assert got == ref
    restkv.detach(model)


def test_off_and_refusals():
    obs, *_ = case(n=30)
    for off in (0, None):
        assert (
            kept_sets(obs, method="snapkv", prompt_chunk=off)[0]
            == kept_sets(obs, method="snapkv")[0]
        )
    with pytest.raises(ValueError, match="prompt_chunk .* and chunk_size"):
        CompressionConfig(method="snapkv", prompt_chunk=8, chunk_size=4)
    with pytest.raises(ValueError, match="prompt_chunk must be"):
        CompressionConfig(method="snapkv", prompt_chunk=-1)
