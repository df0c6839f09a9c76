"""Memory linear in the prompt: the blocked float32 work (H2O, pivot merging, refinement, ReST-KV's
query_window) equals the unblocked computation with a small block forced, and KVzip's passes and sweep mode
hold no second full copy of the cache."""

from __future__ import annotations

import torch

from restkv.config import CompressionConfig
from restkv.methods import h2o
from restkv.scoring.observe import Observation
from restkv.strategies import merge


def _obs(b=1, hq=4, hkv=2, n=40, d=8, window=6, budget=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1:, :5] = False  # a left-padded second sample
    return Observation(q, k, v, valid, window=window, budget=budget, scaling=d**-0.5)


def test_h2o_low_precision_keys_equal_a_float64_loop():
    obs = _obs(b=2, n=37, dtype=torch.bfloat16)
    cfg = CompressionConfig(method="h2o").score_knobs()
    got = h2o.score(obs, cfg)
    q, k = obs.queries.double(), obs.keys.double().repeat_interleave(2, 1)
    ref = torch.zeros(2, 4, 37, dtype=torch.float64)
    for b in range(2):
        real = obs.key_valid[b]
        for t in range(37):
            if not real[t]:
                continue
            seen = real.clone()
            seen[t + 1 :] = False
            logits = (q[b, :, t] [:, None] @ k[b].transpose(-1, -2))[:, 0] * obs.scaling
            ref[b] += logits.masked_fill(~seen, float("-inf")).softmax(-1)
    torch.testing.assert_close(got.double(), ref[..., : obs.prefix_len], rtol=1e-4, atol=1e-5)


def test_pivot_merge_blocked_equals_one_block(monkeypatch):
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 50, 8, generator=g), torch.randn(2, 3, 50, 8, generator=g)
    idx = torch.randperm(50, generator=g)[:12].sort().values.expand(2, 3, 12).contiguous()
    evicted = torch.ones(2, 3, 50, dtype=torch.bool).scatter_(2, idx, False)
    whole = merge.pivot_merge(k.double(), v.double(), idx, evicted)
    monkeypatch.setattr(merge, "MERGE_BLOCK", 12 * 7)  # blocks of 7 entries
    blocked = merge.pivot_merge(k.double(), v.double(), idx, evicted)
    for a, b in zip(blocked, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
