"""Expected Attention, KeyDiff and DefensiveKV against float64 loops written from their definitions."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rope_embed

from restkv.config import CompressionConfig
from restkv.scoring.observe import Observation, wo_factor
from restkv.scoring.rope import Rope
from restkv.eviction.select import raw_scores

D = 8


def rotation(p: int, d: int = D, base: float = 10000.0) -> torch.Tensor:
    """The RoPE matrix [d, d] of position p, float64: pair (i, i + d/2) rotated by p / base^(2i/d)."""
    R = torch.zeros(d, d, dtype=torch.float64)
    h = d // 2
    for i in range(h):
        a = p * base ** (-2 * i / d)
        R[i, i], R[i, i + h], R[i + h, i], R[i + h, i + h] = math.cos(a), -math.sin(a), math.sin(a), math.cos(a)
    return R


def case(b=2, hq=4, hkv=2, n=26, pad=(0, 5), window=4, budget=12, seed=0, dtype=torch.float32):
    """An observation with left padding ``pad`` per sample, its pre-RoPE queries [b, Hq, n, d] float64
    and the positions [b, n] (-1 on padding). Queries are RoPE-rotated by explicit matrices."""
    g = torch.Generator().manual_seed(seed)
    q_pre = torch.randn(b, hq, n, D, generator=g, dtype=torch.float64) * 0.7 + torch.randn(hq, 1, D, generator=g,
                                                                                          dtype=torch.float64)
    k = torch.randn(b, hkv, n, D, generator=g, dtype=torch.float64) * 1.3
    v = torch.randn(b, hkv, n, D, generator=g, dtype=torch.float64)
    valid = torch.ones(b, n, dtype=torch.bool)
    pos = torch.zeros(b, n, dtype=torch.long)
    for i, p in enumerate(pad):
        valid[i, :p] = False
        pos[i] = torch.arange(n) - p
    pos = pos.masked_fill(~valid, -1)
    q_post = q_pre.clone()
    for i in range(b):
        for t in range(n):
            q_post[i, :, t] = q_pre[i, :, t] @ rotation(max(int(pos[i, t]), 0)).T
    W = torch.randn(16, hq * D, generator=g, dtype=torch.float64)
    obs = Observation(q_post.to(dtype), k.to(dtype), v.to(dtype), valid, window=window, budget=budget,
                      scaling=D**-0.5, wo_weight=W.float(), wo_factor=wo_factor(W.float(), hq),
                      rope=Rope.of(rope_embed(D), pos.clamp_min(0)))
    return obs, q_pre, k, v, W, pos


def scores_of(obs, **knobs):
    cfg = CompressionConfig(max_capacity_prompt=obs.budget, window_size=obs.window, **knobs)
    return raw_scores(obs, cfg)


def expected_attention_loops(q_pre, k, v, pos, P, n_sink, n_future, eps, covariance=True, vnorm=True):
    """[b, Hq, P] float64: softmax over the non-sink keys of s mu'.k + s^2 k^T S' k / 2, with mu' = R mu,
    S' = R S R^T, R the mean RoPE matrix of the next n_future positions; (a + eps) ||v||; sinks max + 1."""
    b, hq, n, d = q_pre.shape
    g, s = hq // k.shape[1], d**-0.5
    out = torch.zeros(b, hq, P, dtype=torch.float64)
    for i in range(b):
        rows = [t for t in range(n) if pos[i, t] >= n_sink]
        nxt = int(pos[i, -1]) + 1
        R = sum(rotation(p) for p in range(nxt, nxt + n_future)) / n_future
        for h in range(hq):
            x = q_pre[i, h, rows]
            mu = x.mean(0)
            S = sum(torch.outer(r - mu, r - mu) for r in x) / len(rows)
            mu, S = R @ mu, R @ S @ R.T
            keys = [j for j in range(n) if pos[i, j] >= n_sink]
            kk = k[i, h // g]
            z = torch.tensor([s * mu @ kk[j] + (s * s / 2 * kk[j] @ S @ kk[j] if covariance else 0.0) for j in keys],
                             dtype=torch.float64)
            a = torch.softmax(z, 0)
            for a_j, j in zip(a, keys):
                if j < P:
                    out[i, h, j] = (a_j + eps) * v[i, h // g, j].norm() if vnorm else a_j
        non_sink = pos[i, :P] >= n_sink
        top = out[i][:, non_sink].max() + 1
        out[i][:, (pos[i, :P] >= 0) & ~non_sink] = top
    return out


@pytest.mark.parametrize("knobs", [dict(), dict(n_sink=0, epsilon=0.02),
                                   dict(use_covariance=False, n_future_positions=1), dict(use_vnorm=False, n_sink=2)])
def test_expected_attention_equals_float64_loops(knobs):
    obs, q_pre, k, v, _, pos = case()
    cfg = {"n_sink": 3, "n_future_positions": 7, **knobs}
    got = scores_of(obs, method="expected_attention", **cfg)
    ref = expected_attention_loops(q_pre, k, v, pos, obs.prefix_len, cfg["n_sink"], cfg["n_future_positions"],
                                   cfg.get("epsilon", 0.0), cfg.get("use_covariance", True), cfg.get("use_vnorm", True))
    real = pos[:, None, : obs.prefix_len] >= 0
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double()[real.expand_as(ref)], ref[real.expand_as(ref)], rtol=2e-5, atol=1e-7)


def test_expected_attention_is_the_expectation_under_a_gaussian_query():
    """Monte Carlo: softmax_j of the score equals E[exp(s q.k_j)] / sum_j, q ~ N(R mu, R S R^T)."""
    obs, q_pre, k, _, _, pos = case(b=1, hq=2, hkv=1, n=30, pad=(0,), window=2, budget=10, seed=3)
    got = scores_of(obs, method="expected_attention", n_sink=0, n_future_positions=5, use_vnorm=False)[0]
    R = sum(rotation(p) for p in range(30, 35)) / 5
    g = torch.Generator().manual_seed(0)
    for h in range(2):
        x = q_pre[0, h]
        mu, S = x.mean(0), torch.cov(x.T, correction=0)
        L = torch.linalg.cholesky(R @ S @ R.T + 1e-12 * torch.eye(D, dtype=torch.float64))
        q = R @ mu + torch.randn(400_000, D, generator=g, dtype=torch.float64) @ L.T
        expected = torch.exp(q @ k[0, 0].T * D**-0.5).mean(0)  # [n]
        ref = (expected / expected.sum())[: obs.prefix_len]
        torch.testing.assert_close(got[h].double(), ref, rtol=2e-2, atol=0)


def test_keydiff_equals_float64_loops():
    obs, _, k, _, _, pos = case(n=20, pad=(0, 4))
    got = scores_of(obs, method="keydiff")
    P = obs.prefix_len
    for i in range(2):
        real = [j for j in range(20) if pos[i, j] >= 0]
        for h in range(2):
            anchor = sum(k[i, h, j] / k[i, h, j].norm() for j in real) / len(real)
            for j in real:
                if j < P:
                    ref = -(k[i, h, j] @ anchor) / (k[i, h, j].norm() * anchor.norm())
                    assert abs(float(got[i, h, j]) - float(ref)) < 1e-6


def window_attention_loops(q_post, k, valid, window):
    """[b, Hq, w, L] float64 softmax attention of the last ``window`` queries (causal, real keys only)."""
    b, hq, n, d = q_post.shape
    g = hq // k.shape[1]
    A = torch.zeros(b, hq, window, n, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            for t in range(window):
                row = n - window + t
                seen = [j for j in range(row + 1) if valid[i, j]]
                z = torch.stack([q_post[i, h, row] @ k[i, h // g, j] * d**-0.5 for j in seen])
                A[i, h, t, seen] = torch.softmax(z, 0)
    return A


def defensive_loops(obs, k, v, W, kernel, mass):
    b, hq, n, d = obs.queries.shape
    hkv, w, P = k.shape[1], obs.window, obs.prefix_len
    g, half = hq // hkv, kernel // 2
    A = window_attention_loops(obs.queries.double(), k, obs.key_valid, w)[..., :P]
    out = torch.zeros(b, hkv, P, dtype=torch.float64)
    for i in range(b):
        norms = torch.zeros(hkv, P, dtype=torch.float64)
        m = torch.zeros(hkv, P, dtype=torch.float64)
        for kv in range(hkv):
            for r in range(g):
                h = kv * g + r
                for j in range(P):
                    norms[kv, j] += sum(abs(W[c, h * d: (h + 1) * d] @ v[i, kv, j]) for c in range(W.shape[0])) / g
                first = int((~obs.key_valid[i]).sum())  # each sample as if alone: pooled over its real entries
                for t in range(w):
                    row = A[i, h, t]
                    pooled = torch.tensor([sum(row[o] for o in range(j - half, j + half + 1) if first <= o < P) / kernel
                                           if j >= first else 0.0 for j in range(P)], dtype=torch.float64)
                    pooled = pooled / pooled.sum() * row.sum()
                    m[kv] = torch.maximum(m[kv], pooled)
        real = obs.key_valid[i, :P]
        s = torch.maximum(m, m[:, real].mean(1, keepdim=True)) * norms / norms.sum(0, keepdim=True)
        bias = A[i, :, :, max(0, P - w):P].sum(-1).mean()
        top = float(s.max().float().nextafter(torch.tensor(float("inf"))))  # ranked just above the rest
        for kv in range(hkv):
            ave = A[i, kv * g:(kv + 1) * g].mean((0, 1))
            p = ave / ave.sum()
            order = sorted(range(P), key=lambda j: -float(p[j]))
            count, total = 0, 0.0
            for c, j in enumerate(order):
                total += float(p[j])
                if total >= mass - bias:
                    count = c
                    break
            for j in order[: min(count, obs.budget - w)]:
                s[kv, j] = top
        out[i] = s
    return out


@pytest.mark.parametrize("mass,budget", [(0.9, 12), (0.5, 14), (1.0, 9)])
def test_defensivekv_equals_float64_loops(mass, budget):
    obs, _, k, v, W, pos = case(n=22, pad=(0, 3), window=4, budget=budget, seed=5)
    got = scores_of(obs, method="defensivekv", first_stage_mass=mass)
    ref = defensive_loops(obs, k, v, W, 5, mass)
    real = (pos[:, None, : obs.prefix_len] >= 0).expand_as(ref)
    torch.testing.assert_close(got.double()[real], ref[real], rtol=2e-5, atol=1e-8)
    assert (got == got.amax(dim=(1, 2), keepdim=True)).sum() > 1, "the first stage takes entries"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["expected_attention", "keydiff", "defensivekv", "criticalkv", "chunkkv"])
def test_low_precision_inputs_give_finite_float32_scores(dtype, method):
    obs, *_ = case(n=40, dtype=dtype, budget=16)
    obs.queries, obs.keys = obs.queries * 30, obs.keys * 30  # near one-hot attention
    got = scores_of(obs, method=method)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
