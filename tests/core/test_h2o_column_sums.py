"""H2O's chunk sums as the vLLM worker forms them (``chunk_score``: ``h2o.column_sums``
without the backend's log-sum-exp, one softmax per block of queries, in place) against a float64 loop of
the definition, ``sum_q softmax(q . K^T scale, causal)[key]``, and against ``h2o.score``'s recomputed sums
with the same kept entries."""

from __future__ import annotations

import pytest
import torch
from test_cost_h2o import Ops

from restkv.config import CompressionConfig
from restkv.methods import h2o
from restkv.vllm.scoring import chunk_score, observation


def case(n, chunk, hq, hkv, d, softcap=None, dtype=torch.float32, seed=0, spread=2.0):
    """The engine's layout: the held keys [n, Hkv, d] and a chunk's queries [chunk, Hq, d] (the last
    positions)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(chunk, hq, d, generator=g) * spread).to(dtype)
    k, v = (torch.randn(n, hkv, d, generator=g).to(dtype) for _ in range(2))
    cfg = CompressionConfig.from_kwargs(method="h2o", max_capacity_prompt=40, window_size=8)
    return observation(cfg, q, k, v, 40, d**-0.5, softcap, 0, 1, window=0), cfg


def loop(obs) -> torch.Tensor:
    """[Hq, n] float64: per head and query, the softmax of its scaled (softcapped) logits over the keys up
    to its position, added to each key's column."""
    q, k = obs.queries[0].double(), obs.keys[0].double()
    hq, r, _ = q.shape
    n = k.shape[1]
    out = torch.zeros(hq, n, dtype=torch.float64)
    for h in range(hq):
        keys = k[h // (hq // k.shape[0])]
        for t in range(r):
            p = n - r + t  # the query's position
            logits = (keys[: p + 1] @ q[h, t]) * obs.scaling
            if obs.softcap:
                logits = torch.tanh(logits / obs.softcap) * obs.softcap
            out[h, : p + 1] += torch.softmax(logits, 0)
    return out


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(
    "n, chunk, hq, hkv, d, dtype",
    [
        (70, 70, 4, 2, 16, torch.float32),  # the whole prompt
        (70, 23, 4, 2, 16, torch.float32),  # a chunk at an offset
        (90, 31, 9, 3, 8, torch.bfloat16),  # SmolLM2's grouping, low-precision entries
        (40, 1, 2, 1, 4, torch.float32),  # one query
    ],
)
def test_sums_equal_a_float64_loop(n, chunk, hq, hkv, d, dtype, softcap):
    obs, cfg = case(n, chunk, hq, hkv, d, softcap, dtype)
    got = chunk_score(obs, cfg)
    assert got.dtype == torch.float32 and got.shape == (hq, n)
    torch.testing.assert_close(got.double(), loop(obs), rtol=2e-5, atol=1e-6)
    recomputed = h2o.score(obs, cfg.score_knobs())[0]  # every query's softmax recomputed
    torch.testing.assert_close(got, recomputed, rtol=2e-5, atol=1e-6)
    keep = min(n, 30)
    assert torch.equal(got.topk(keep).indices.sort().values, recomputed.topk(keep).indices.sort().values)


def test_wide_logits_stay_exact():
    """Logits spread over hundreds (exponentials far below float32's normal range) sum as the loop does."""
    obs, cfg = case(64, 40, 4, 2, 16, spread=60.0, seed=3)
    torch.testing.assert_close(chunk_score(obs, cfg).double(), loop(obs), rtol=2e-5, atol=1e-6)


def test_one_product_and_one_softmax_per_block():
    """Per block of queries: one product, one softmax; no second exponential, max or division, and no
    mask over every key (the only masked_fill is on the block's own keys)."""
    obs, cfg = case(300, 300, 4, 2, 16)
    blocks = -(-300 // max(1, 16 * 2 // 4))
    with Ops() as ops:
        chunk_score(obs, cfg)
    assert ops.count["bmm"] + ops.count["mm"] == blocks, ops.count
    assert ops.count["_softmax"] + ops.count["softmax"] == blocks, ops.count
    for other in ("exp", "exp_", "amax", "max", "div", "div_", "clamp_min_", "logsumexp"):
        assert not ops.count[other], (other, ops.count)
