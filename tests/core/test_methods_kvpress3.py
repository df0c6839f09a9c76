"""kvpress's CapPress, DuoAttentionPress, MergingPress, LUKVPress and ExpectedAttentionStatsPress
against float64 loops written from their reference code."""

from __future__ import annotations

import math

import pytest
import torch
from test_methods_2026 import case, rotation, scores_of


def cap_loops(q_pre, k, v, pos, P, n_sink=4, n_future=512, tau=5.0, eps=1e-6):
    """[b, Hkv, P] float64: kvpress CapPress.score, one sample and head at a time."""
    b, hq, n, d = q_pre.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(b, hkv, P, dtype=torch.float64)
    for i in range(b):
        rows = [t for t in range(n) if pos[i, t] >= n_sink]
        nxt = int(pos[i, -1]) + 1
        R = sum(rotation(p) for p in range(nxt, nxt + n_future)) / n_future
        top = -math.inf
        for h in range(hq):
            mu = R @ q_pre[i, h, rows].mean(0)
            kk, vv = k[i, h // g, rows], v[i, h // g, rows]
            c = torch.stack([mu @ x / (mu.norm() * x.norm()) for x in kk]).clamp(-1, 1)
            w = torch.exp(tau * c - (tau * c).max())
            A = torch.eye(d, dtype=torch.float64)
            for w_j, x in zip(w, vv):
                A += (w_j + eps) * torch.outer(x, x)
            lev = torch.stack([x @ torch.linalg.solve(A, x) for x in vv])
            for s, t in zip(w * lev, rows):
                if t < P:
                    out[i, h // g, t] += s / g
        top = max(top, float(out[i, :, [t for t in rows if t < P]].max()))
        for t in range(P):
            if 0 <= pos[i, t] < n_sink:
                out[i, :, t] = top + 1
    return out


@pytest.mark.parametrize("knobs", [{}, dict(tau=2.0, n_sink=2, n_future_positions=7, epsilon=0.1)])
def test_cap_equals_float64_loops(knobs):
    obs, q_pre, k, v, _, pos = case(n=26, pad=(0, 5), window=4, budget=12, seed=3)
    got = scores_of(obs, method="cap", **knobs)
    cfg = dict(n_sink=4, n_future=512, tau=5.0, eps=1e-6)
    cfg.update({"n_future" if a == "n_future_positions" else "eps" if a == "epsilon" else a: x
                for a, x in knobs.items()})
    ref = cap_loops(q_pre, k, v, pos, obs.prefix_len, **cfg)
    real = (pos[:, None, : obs.prefix_len] >= 0).expand_as(ref)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double()[real], ref[real], rtol=2e-4, atol=1e-7)

