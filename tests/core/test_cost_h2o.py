"""H2O's sums from the backend's per-query log-sum-exp (``h2o.column_sums``, ``chunk_score(lse=...)``): equal
to a float64 loop over every query and the keys it sees, to the recomputed softmax's sums, with the same
kept entries, from one product and one exponential per block of queries (no max, no second normalisation)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from restkv.config import CompressionConfig
from restkv.methods import h2o
from restkv.scoring.observe import Observation
from restkv.vllm.scoring import chunk_score, observation


def engine_case(n=70, chunk=23, hq=4, hkv=2, d=16, softcap=None, dtype=torch.bfloat16, seed=0):
    """The engine's layout: the held keys [n, Hkv, d], a prompt chunk's queries [chunk, Hq, d] (the last
    positions) and their float64 log-sum-exp [Hq, chunk] over the keys each sees (the backend's)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(chunk, hq, d, generator=g) * 2).to(dtype)
    k, v = (torch.randn(n, hkv, d, generator=g).to(dtype) for _ in range(2))
    cfg = CompressionConfig.from_kwargs(method="h2o", max_capacity_prompt=40, window_size=8)
    obs = observation(cfg, q, k, v, 40, d**-0.5, softcap, 0, 1, window=0)
    return obs, cfg, reference_logits(obs)


def reference_logits(obs: Observation) -> torch.Tensor:
    """float64 logits [Hq, r, n] of the held queries, -inf on the keys a query does not see."""
    q, k = obs.queries[0].double(), obs.keys[0].double()
    hq, r, _ = q.shape
    n = k.shape[1]
    logits = (q @ k.repeat_interleave(hq // k.shape[0], 0).transpose(-1, -2)) * obs.scaling
    if obs.softcap:
        logits = torch.tanh(logits / obs.softcap) * obs.softcap
    position = torch.arange(n - r, n)[:, None]
    return logits.masked_fill(torch.arange(n) > position, float("-inf"))


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("chunk", [23, 70])
def test_column_sums_equal_a_float64_loop(softcap, chunk):
    obs, cfg, logits = engine_case(chunk=chunk, softcap=softcap)
    lse = torch.logsumexp(logits, -1)  # [Hq, r]
    ref = torch.zeros(logits.shape[0], logits.shape[-1], dtype=torch.float64)
    for h in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            ref[h] += torch.exp(logits[h, t] - lse[h, t])
    got = chunk_score(obs, cfg, lse.float())
    torch.testing.assert_close(got.double(), ref[:, : obs.prefix_len], rtol=2e-5, atol=1e-6)
    recomputed = h2o.score(obs, cfg.score_knobs())[0]  # every query's softmax recomputed
    torch.testing.assert_close(got, recomputed, rtol=2e-5, atol=1e-6)
    assert torch.equal(got.topk(30).indices.sort().values, recomputed.topk(30).indices.sort().values)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_one_product_and_one_exponential_per_block():
    obs, cfg, logits = engine_case(n=300, chunk=300, hq=4, hkv=2, d=16)
    lse = torch.logsumexp(logits, -1).float()
    blocks = -(-300 // max(1, 16 * 2 // 4))
    with Ops() as ops:
        chunk_score(obs, cfg, lse)
    products = ops.count["bmm"] + ops.count["mm"]
    assert products == blocks and ops.count["exp_"] + ops.count["exp"] == blocks, ops.count
    for second_pass in ("amax", "max", "softmax", "_softmax", "div_", "div", "logsumexp"):
        assert not ops.count[second_pass], (second_pass, ops.count)
    with Ops() as ops:  # the recomputed softmax: a max and a normalisation per block
        h2o.score(obs, cfg.score_knobs())
    assert ops.count["amax"] == blocks and ops.count["div_"] == blocks
