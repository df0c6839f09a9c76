"""Scores against independent references: brute force, float64 loops, the paper's formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from restkv.strategies.budgets import pyramid_budgets
from restkv.config import CompressionConfig
from restkv.strategies.merge import cam_values, pivot_merge
from restkv.methods import restkv as rk
from restkv.scoring.observe import Observation, wo_factor
from restkv.eviction.select import reduce_groups, select
from restkv.scoring.smoothing import aggregate_rows, ema_weights


def rk_score(obs, cfg, R=None):
    """ReST-KV's score as the selection calls it: W_O through the observation, only the declared knobs."""
    obs.wo_factor = R
    return rk.score(obs, cfg.score_knobs())


def _obs(b=1, hq=4, hkv=2, n=40, d=8, window=6, budget=16, dtype=torch.float32, seed=0, key_valid=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    valid = torch.ones(b, n, dtype=torch.bool) if key_valid is None else key_valid
    return Observation(q, k, v, valid, window=window, budget=budget, scaling=d**-0.5)


def test_indicator_equals_brute_force_output_change():
    """One query, one head: A/(1-A) ||(O - v_n) W_O|| is exactly the change of the layer output when n is removed."""
    torch.manual_seed(0)
    n, d, hidden = 30, 8, 24
    q = torch.randn(d, dtype=torch.float64)
    k = torch.randn(n, d, dtype=torch.float64) * 1.5
    v = torch.randn(n, d, dtype=torch.float64)
    W = torch.randn(hidden, d, dtype=torch.float64)
    scale = d**-0.5

    def output(keep):
        a = torch.softmax((k[keep] @ q) * scale, 0)
        return W @ (a @ v[keep])

    full = output(torch.ones(n, dtype=torch.bool))
    brute = []
    for i in range(n - 1):
        keep = torch.ones(n, dtype=torch.bool)
        keep[i] = False
        brute.append((output(keep) - full).norm())
    brute = torch.stack(brute)

    obs = Observation(
        queries=q.view(1, 1, 1, d).expand(1, 1, n, d).clone(),  # only the last row is observed
        keys=k.view(1, 1, n, d), values=v.view(1, 1, n, d), key_valid=torch.ones(1, n, dtype=torch.bool),
        window=1, budget=8, scaling=scale,
    )
    cfg = CompressionConfig(metric_mode="before", temporal="mean", pooling="none", max_capacity_prompt=8, window_size=1)
    R = wo_factor(W.float(), num_heads=1)
    got = rk_score(obs, cfg, R)[0, 0]
    torch.testing.assert_close(got.double(), brute, rtol=2e-4, atol=1e-6)


def test_after_mode_matches_paper_formula_in_float64():
    obs = _obs(b=2, hq=4, hkv=2, n=36, d=8, window=6)
    hidden = 20
    W = torch.randn(hidden, 4 * 8)
    alpha = 0.3
    cfg = CompressionConfig(metric_mode="after", use_ema=True, alpha=alpha, pooling="none", tau=1.5,
                            max_capacity_prompt=16, window_size=6)
    got = rk_score(obs, cfg, wo_factor(W, 4))
    P = obs.prefix_len
    ref = torch.zeros(2, 4, P, dtype=torch.float64)
    A = obs.window_attention.double()
    for b in range(2):
        for h in range(4):
            kv = h // 2
            c = A[b, h, 0, :P]
            for i in range(1, 6):  # the recursive EMA
                c = alpha * A[b, h, i, :P] + (1 - alpha) * c
            vals = obs.values[b, kv, :P].double()
            o = c @ vals
            Wh = W[:, h * 8 : (h + 1) * 8].double()
            for j in range(P):
                ref[b, h, j] = c[j] / (1 - c[j]) * (Wh @ (o - vals[j])).norm() ** 1.5
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-7)


def test_before_mode_with_norm_matches_loop_reference():
    obs = _obs(b=1, hq=2, hkv=1, n=24, d=4, window=4, budget=10)
    cfg = CompressionConfig(metric_mode="before", use_ema=False, use_norm=True, use_wo=False, pooling="none",
                            max_capacity_prompt=10, window_size=4)
    got = rk_score(obs, cfg)
    A, P = obs.window_attention.double(), obs.prefix_len
    v = obs.values[0, 0].double()
    ref = torch.zeros(2, P, dtype=torch.float64)
    for h in range(2):
        for r in range(4):
            O = A[0, h, r] @ v
            for j in range(P):
                ref[h, j] += A[0, h, r, j] / (1 - A[0, h, r, j]) * (O - v[j]).norm() / O.norm() / 4
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-4, atol=1e-7)


def test_ema_is_the_recursion():
    x = torch.randn(3, 9, 11)
    for alpha in (0.3, 1.0, 0.05):
        c = x[:, 0]
        for i in range(1, 9):
            c = alpha * x[:, i] + (1 - alpha) * c
        torch.testing.assert_close(aggregate_rows(x, "ema", alpha), c)
        c = x[:, -1]  # inv-ema: the same recursion from the newest row back to the oldest
        for i in range(7, -1, -1):
            c = alpha * x[:, i] + (1 - alpha) * c
        torch.testing.assert_close(aggregate_rows(x, "inv-ema", alpha), c)
    assert abs(float(ema_weights(32, 0.3).sum()) - 1) < 1e-6
    torch.testing.assert_close(aggregate_rows(x, "mean"), x.mean(1))
    torch.testing.assert_close(aggregate_rows(x, "last"), x[:, -1])


def _adaptive_reference(scores, drift, kernel_size, scale):
    out = torch.empty_like(scores)
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            t = float(drift[b, h])
            steps = int(abs(t) // scale)
            k = max(kernel_size, 2 * steps + 1)
            shift = int(torch.floor(torch.tensor(t / scale))) + (1 if t <= 0 else 0)
            shift = max(-(k // 2), min(k // 2, shift))
            x = F.pad(scores[b, h][None, None], (k // 2 - shift, k // 2 + shift), mode="replicate")
            out[b, h] = F.avg_pool1d(x, k, stride=1)[0, 0]
    return out


def test_adaptive_pooling_equals_per_head_reference():
    torch.manual_seed(3)
    scores = torch.rand(2, 5, 300)
    drift = torch.tensor([[0.0, 2500.0, -2500.0, 9000.0, -7999.0], [1999.0, -1.0, 4000.0, -4000.0, 12.0]])
    got = rk.adaptive_pool(scores, drift, kernel_size=7, scale=2000.0)
    torch.testing.assert_close(got, _adaptive_reference(scores, drift, 7, 2000.0))
    got = rk.adaptive_pool(scores, drift, kernel_size=1, scale=1000.0)
    torch.testing.assert_close(got, _adaptive_reference(scores, drift, 1, 1000.0))


def test_adaptive_pooling_bounded_by_its_reach_is_the_same():
    """``bounded`` (while decoding): the padding of the widest kernel the reach allows, no host read;
    the same averages as the padding of the widest kernel read from the host."""
    torch.manual_seed(4)
    for reach, scale, kernel in [(300, 40.0, 7), (300, 7.0, 3), (1000, 100.0, 1)]:
        scores = torch.rand(2, 6, reach)
        drift = (torch.rand(2, 6) * 2 - 1) * (reach - 1)
        drift[0, :2] = torch.tensor([0.0, -(reach - 1.0)])
        wide = rk.adaptive_pool(scores, drift, kernel, scale, reach=reach, bounded=True)
        assert torch.equal(wide, rk.adaptive_pool(scores, drift, kernel, scale, reach=reach))
        torch.testing.assert_close(wide, _adaptive_reference(scores, drift, kernel, scale))


def test_window_drift_follows_attention_mass():
    A = torch.zeros(1, 1, 8, 100)
    A[..., :4, 10:20] = 1.0  # first half looks early
    A[..., 4:, 60:70] = 1.0  # second half looks late
    assert float(rk.window_drift(A, 10)) == pytest.approx(-50.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["after", "before"])
def test_near_one_hot_low_precision_inputs_give_finite_scores(dtype, mode):
    obs = _obs(dtype=dtype, n=64, d=16)
    obs.keys[:, :, 5] = 60.0  # one key dominates every query
    obs.queries[:] = 60.0
    for pooling in ("none", "adaptive", "avgpool", "maxpool"):
        norm = dict(use_norm=True) if mode == "before" else {}
        cfg = CompressionConfig(metric_mode=mode, pooling=pooling, max_capacity_prompt=16, window_size=6, **norm)
        s = rk_score(obs, cfg, wo_factor(torch.randn(32, 64).to(dtype), 4))
        assert s.dtype == torch.float32 and torch.isfinite(s).all()
        per_key = s[0].mean(0)
        assert per_key[5] == per_key.max() and per_key.max() > 0


def test_gqa_reduction_mean_and_max():
    s = torch.arange(24.0).view(1, 4, 6)
    torch.testing.assert_close(reduce_groups(s, 2, "mean"), torch.stack([s[0, :2].mean(0), s[0, 2:].mean(0)])[None])
    torch.testing.assert_close(reduce_groups(s, 2, "max"), torch.stack([s[0, 1], s[0, 3]])[None])


@pytest.mark.parametrize("n_layers,budget,window,beta,length", [(32, 128, 32, 20, 4000), (30, 512, 32, 20, 9000), (5, 64, 8, 5, 100), (3, 24, 8, 20, 80)])
def test_pyramid_schedule_conserves_the_total(n_layers, budget, window, beta, length):
    sizes = pyramid_budgets(budget, window, n_layers, beta, length)
    assert sum(sizes) == n_layers * budget
    assert sizes == sorted(sizes, reverse=True) and min(sizes) > window
    assert max(sizes) <= length


def test_compress_keeps_window_and_top_scores():
    obs = _obs(n=50, window=6, budget=20)
    cfg = CompressionConfig(method="snapkv", pooling="none", max_capacity_prompt=20, window_size=6)
    kept = select(obs, cfg)
    s = reduce_groups(obs.window_attention[..., :44].sum(-2), 2, "mean")
    for h in range(2):
        expect = set(s[0, h].topk(14).indices.tolist()) | set(range(44, 50))
        assert set(kept.positions[0, h].tolist()) == expect
    assert torch.equal(kept.keys[0, 1, 3], obs.keys[0, 1, kept.positions[0, 1, 3]])


def test_cam_merge_leaves_inputs_alone_and_matches_loop():
    obs = _obs(n=30, window=4, budget=12)
    before = obs.values.clone()
    scores = torch.rand(1, 2, 26)
    kept = torch.zeros(1, 2, 30, dtype=torch.bool)
    kept[..., 26:] = True
    kept[..., [0, 3, 7, 11, 15, 20, 22, 25]] = True
    merged = cam_values(obs, scores, kept)
    assert torch.equal(obs.values, before)
    ref = obs.values.clone().double()
    for h in range(2):
        top = scores[0, h][kept[0, h, :26]].max()
        for e in range(26):
            if not kept[0, h, e]:
                p = min(1.0, float(scores[0, h, e] / top))
                for j in range(e + 1, min(30, e + 1 + 4)):
                    ref[0, h, j] += p * obs.values[0, h, e].double() / 4
    torch.testing.assert_close(merged.double(), ref, rtol=1e-5, atol=1e-6)


def test_pivot_merge_matches_loop_reference():
    torch.manual_seed(0)
    k, v = torch.randn(1, 1, 12, 4), torch.randn(1, 1, 12, 4)
    idx = torch.tensor([[[1, 4, 9, 10, 11]]])
    evicted = torch.ones(1, 1, 12, dtype=torch.bool)
    evicted[0, 0, idx[0, 0]] = False
    mk, mv = pivot_merge(k, v, idx, evicted)
    rk_, rv = k[0, 0, idx[0, 0]].clone(), v[0, 0, idx[0, 0]].clone()
    sums_k, sums_v, counts = rk_.clone(), rv.clone(), torch.ones(5)
    for e in range(12):
        if evicted[0, 0, e]:
            t = int(F.cosine_similarity(k[0, 0, e][None], k[0, 0, idx[0, 0]]).argmax())
            sums_k[t] += (k[0, 0, e] + rk_[t]) / 2
            sums_v[t] += (v[0, 0, e] + rv[t]) / 2
            counts[t] += 1
    torch.testing.assert_close(mk[0, 0], sums_k / counts[:, None])
    torch.testing.assert_close(mv[0, 0], sums_v / counts[:, None])


def test_scale_free_gqa_reductions_ignore_a_loud_head():
    quiet = torch.tensor([[5.0, 1.0, 4.0, 0.5, 3.0, 2.0]])  # prefers entry 0
    loud = torch.tensor([[0.2, 0.9, 0.1, 0.3, 0.4, 0.35]]) * 100  # prefers entry 1, 100x larger scale
    same = quiet * 0.9 + torch.rand(1, 6) * 0.01  # a third head agreeing with the quiet one
    s = torch.stack([quiet, loud, same], 1)  # [1, 3 query heads, 6] -> one KV head
    assert int(reduce_groups(s, 1, "mean").argmax()) == 1  # the loud head decides
    assert int(reduce_groups(s, 1, "max").argmax()) == 1
    for how in ("sum_norm", "rank"):
        assert int(reduce_groups(s, 1, how).argmax()) == 0, how
    ranks = reduce_groups(s[:, :1], 1, "rank")  # one head per group: already per KV head
    torch.testing.assert_close(ranks, s[:, :1])
    two_groups = reduce_groups(torch.stack([quiet, loud, same, loud], 1), 2, "rank")
    torch.testing.assert_close(two_groups[0, 0], (quiet.argsort(-1).argsort(-1) + loud.argsort(-1).argsort(-1))[0].float() / 12)


@pytest.mark.parametrize("mode", ["after", "before"])
def test_blockwise_values_give_the_same_scores(mode, monkeypatch):
    import restkv.scoring.observe as observation

    obs = _obs(b=2, n=50, window=6, dtype=torch.bfloat16)
    norm = dict(use_norm=True) if mode == "before" else {}
    cfg = CompressionConfig(metric_mode=mode, max_capacity_prompt=16, window_size=6, **norm)
    R = wo_factor(torch.randn(32, 32), 4)
    whole = rk_score(obs, cfg, R)
    monkeypatch.setattr(observation, "VALUE_BLOCK", 7)
    blocked = rk_score(_obs(b=2, n=50, window=6, dtype=torch.bfloat16), cfg, R)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)
