"""Set-level refinement's step memory: the float32 tensors a refined selection holds at once stay within 4x
the layer's K+V (``benchmarks/scaling.py``'s bar at 8K) for every refine configuration the docs name
(docs/usage.md, docs/gpu.md, docs/results.md), counted exactly (every tensor the step allocates, at its
peak), on a layer whose o_proj is to its K+V as Llama-3-8B's at 8K; and the blocked terms give the same kept
sets and errors as one block. Merging's step (``merge="pivot"``, ``"value"``) within the same 4x."""

from __future__ import annotations

import pytest
import torch
from helpers import PeakBytes

from restkv.config import CompressionConfig
from restkv.eviction.select import select
from restkv.scoring import output_error as oe
from restkv.scoring.observe import Observation, wo_factor

REFINE_CONFIGS = [
    "refine_rounds=2",
    "refine_rounds=2,refine_pool=16",
    "refine_rounds=8",
    "refine_rounds=1,refine_candidates=boundary",
    "refine_rounds=4,refine_candidates=boundary",
]


def layer(n=4096, hq=4, hkv=1, d=64, hidden=2048, window=8, budget=512, seed=0):
    """A bf16 layer in the proportions of ``benchmarks/scaling.py``'s at 8K (8 query / 2 KV heads, hidden
    4096, window 32, budget 1024): o_proj's float32 copy twice the K+V, the window attention and the
    swap terms of a pool of 32 half of it each."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=g).bfloat16() for h in (hq, hkv, hkv))
    o_proj = (torch.randn(hidden, hq * d, generator=g) / hidden**0.5).bfloat16()
    obs = Observation(q, k, v, torch.ones(1, n, dtype=torch.bool), window=window, budget=budget,
                      scaling=d**-0.5, wo_weight=o_proj, wo_factor=wo_factor(o_proj, hq))
    return obs, 2 * k.numel() * k.element_size()


def knobs(spec: str) -> dict:
    return {key: (int(value) if value.isdigit() else value)
            for key, value in (item.split("=") for item in spec.split(","))}


@pytest.mark.parametrize("spec", REFINE_CONFIGS)
def test_refined_step_holds_at_most_4x_the_layer_kv(spec):
    obs, kv_bytes = layer()
    cfg = CompressionConfig(method="snapkv", max_capacity_prompt=512, window_size=8, **knobs(spec))
    peak = second_select_peak(obs, cfg)  # the first: the shared window attention, as SnapKV's step computes it
    assert peak <= 4 * kv_bytes, (spec, peak / kv_bytes)
    assert peak > kv_bytes  # it does count the step's own float32 work (the window attention)


def test_peak_bytes_counts_what_is_held_at_once():
    with PeakBytes() as mem:
        a = torch.zeros(1000)  # 4000 bytes, held
        b = a.view(10, 100)  # a view: nothing
        c = torch.ones(500) + 1  # 2000 (the temporary freed before the sum is kept)
        del c
        d = torch.ones(250)  # 1000 more while a is held
    assert mem.peak == 4000 + 2000 + 2000  # a, the ones and their sum
    assert mem.held == 4000 + 1000
    del a, b, d


@pytest.mark.parametrize("seed", [0, 1])
def test_blocked_terms_give_the_one_block_kept_set(seed, monkeypatch):
    obs, _ = layer(n=192, hq=4, hkv=2, d=16, hidden=64, seed=seed)
    cfg = CompressionConfig(method="restkv", max_capacity_prompt=48, window_size=8, refine_rounds=3,
                            refine_pool=8)
    monkeypatch.setattr(oe, "TERMS_BLOCK", 1 << 40)  # one block
    whole = select(obs, cfg)
    obs.memo = {}
    monkeypatch.setattr(oe, "TERMS_BLOCK", 4 * 4 * 2 * 8 * 5)  # blocks of 5 entries
    blocked = select(obs, cfg)
    assert torch.equal(whole.index, blocked.index)


@pytest.mark.parametrize("spec", [{"method": "restkv", "window_size": 32}, {"preset": "paper"}], ids=["default", "paper"])
def test_restkv_step_holds_at_most_4x_the_layer_kv(spec):
    """ReST-KV's own step (its output distances a block of values at a time) at 4K, in Llama-3-8B's head
    proportions (4 query heads per KV head, head_dim 128, window 32), budget 1024: within the same 4x."""
    obs, kv_bytes = layer(d=128, hidden=512, window=32, budget=1024)
    peak = second_select_peak(obs, CompressionConfig.from_kwargs(max_capacity_prompt=1024, **spec))
    assert kv_bytes < peak <= 4 * kv_bytes, peak / kv_bytes


def second_select_peak(obs, cfg) -> int:
    """The peak bytes of ``select`` on ``obs`` run a second time (the first warms its allocations)."""
    select(obs, cfg)
    obs.memo = {}
    with torch.no_grad(), PeakBytes() as mem:
        kept = select(obs, cfg)
    del kept
    return mem.peak


@pytest.mark.parametrize("merge", ["pivot", "value"])
def test_merging_step_holds_at_most_4x_the_layer_kv(merge):
    """SnapKV's step with merging at 8K, on ``benchmarks/scaling.py``'s heads (8 query / 2 KV, head_dim
    128, window 32, budget 1024): the key similarity and the sums into the kept entries are formed a
    block at a time, within 4x the layer's K+V."""
    obs, kv_bytes = layer(n=8192, hq=8, hkv=2, d=128, hidden=512, window=32, budget=1024)
    peak = second_select_peak(obs, CompressionConfig(method="snapkv", max_capacity_prompt=1024, window_size=32, merge=merge))
    assert kv_bytes < peak <= 4 * kv_bytes, peak / kv_bytes
