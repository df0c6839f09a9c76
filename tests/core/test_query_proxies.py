"""ReST-KV's proxies for the future queries (``query_window``, ``query_proxy``) against float64 loops."""

from __future__ import annotations

import pytest
import torch
from helpers import prompt, sweep_equals_separate_runs, tiny_model
from test_methods_2026 import case, expected_attention_loops, scores_of

import restkv


def causal_attention(q, k, valid, scaling):
    """[Hq, L, L] float64 softmax attention of every query of one sample (causal, padding masked)."""
    hq, n, _ = q.shape
    g = hq // k.shape[0]
    logits = torch.einsum("hqd,hkd->hqk", q.double(), k.double().repeat_interleave(g, 0)) * scaling
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool)) & valid[None, :]
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)


def restkv_from_row(c, v, W, h, hq, d):
    """The indicator c_j / (1 - c_j) ||W_O^h (o - v_j)|| of one head's aggregated row c [P] (o = c @ v)."""
    o = c @ v
    Wh = W[:, h * d : (h + 1) * d].double()
    return torch.stack([c[j] / (1 - c[j]) * (Wh @ (o - v[j])).norm() for j in range(len(c))])


@pytest.mark.parametrize("rows", [0, 4, 9, 26])
def test_query_window_matches_float64_loop(rows):
    """The last ``rows`` queries (0: the window's 4), averaged over time: the paper's after-mode indicator."""
    obs, _, k, v, W, pos = case()
    got = scores_of(obs, method="restkv", pooling="none", query_window=rows)
    P, (b, hq, n, d) = obs.prefix_len, obs.queries.shape
    r = rows or obs.window
    for i in range(b):
        A = causal_attention(obs.queries[i], obs.keys[i], obs.key_valid[i], obs.scaling)
        real = pos[i, :P] >= 0
        for h in range(hq):
            c = A[h, n - r :, :P][obs.key_valid[i, n - r :]].mean(0)  # the real queries only
            ref = restkv_from_row(c, v[i, h // (hq // k.shape[1]), :P], W, h, hq, d)
            torch.testing.assert_close(got[i, h][real].double(), ref[real], rtol=1e-4, atol=1e-7)


def test_query_window_of_the_window_is_the_default():
    obs, *_ = case()
    assert torch.equal(scores_of(obs, method="restkv", query_window=obs.window), scores_of(obs, method="restkv"))


@pytest.mark.parametrize("proxy", ["expected", "both"])
def test_expected_proxy_matches_float64_loop(proxy):
    """The row is ExpectedAttention's expected attention (or its mean with the window's); sinks kept first."""
    obs, q_pre, k, v, W, pos = case()
    knobs = dict(n_sink=3, n_future_positions=7)
    got = scores_of(obs, method="restkv", pooling="none", query_proxy=proxy, **knobs)
    P, (b, hq, n, d) = obs.prefix_len, obs.queries.shape
    e = expected_attention_loops(q_pre, k, v, pos, P, 3, 7, 0.0, vnorm=False)  # sinks: max + 1, replaced below
    for i in range(b):
        A = causal_attention(obs.queries[i], obs.keys[i], obs.key_valid[i], obs.scaling)
        counted = pos[i, :P] >= 3
        ref = torch.zeros(hq, P, dtype=torch.float64)
        for h in range(hq):
            c = e[i, h].masked_fill(~counted, 0.0)
            if proxy == "both":
                c = (c + A[h, n - obs.window :, :P].mean(0)) / 2
            ref[h] = restkv_from_row(c, v[i, h // (hq // k.shape[1]), :P], W, h, hq, d)
        sinks = (pos[i, :P] >= 0) & ~counted  # left out of the expected row: kept first with either proxy
        ref[:, sinks] = ref[:, counted].max() + 1
        real = pos[i, :P] >= 0
        torch.testing.assert_close(got[i][:, real].double(), ref[:, real], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("knobs, field", [(dict(query_window=-1), "query_window"),
                                          (dict(query_proxy="future"), "query_proxy"),
                                          (dict(query_proxy="expected", metric_mode="before"), "query_proxy"),
                                          (dict(n_future_positions=8), "n_future_positions")])
def test_bad_proxy_knobs_name_the_knob(knobs, field):
    model = tiny_model()
    with pytest.raises(ValueError, match=field):
        restkv.configure(model, method="restkv", **knobs)


@pytest.mark.parametrize("knobs", [dict(query_window=48), dict(query_proxy="both"),
                                   dict(query_proxy="expected", query_window=12, temporal="ema")])
def test_proxies_in_sweep_mode_equal_separate_runs(knobs):
    model = tiny_model()
    ids = prompt(80)
    configs = [dict(method="restkv", max_capacity_prompt=24, window_size=4, **knobs),
               dict(method="restkv", max_capacity_prompt=24, window_size=4)]
    (_, kept), (_, default) = sweep_equals_separate_runs(model, ids, configs, n=4)
    assert any(not torch.equal(a, b) for a, b in zip(kept, default) if a is not None)  # the knob changes the kept set


def test_worst_case_over_queries_in_before_mode_matches_float64_loop():
    """temporal='max': each entry's largest per-query indicator over the observed queries."""
    obs, _, k, v, W, pos = case()
    got = scores_of(obs, method="restkv", pooling="none", metric_mode="before", temporal="max", query_window=9)
    P, (b, hq, n, d) = obs.prefix_len, obs.queries.shape
    g = hq // k.shape[1]
    for i in range(b):
        A = causal_attention(obs.queries[i], obs.keys[i], obs.key_valid[i], obs.scaling)
        real = pos[i, :P] >= 0
        for h in range(hq):
            vals = v[i, h // g]
            Wh = W[:, h * d : (h + 1) * d].double()
            per_query = []
            for q in range(n - 9, n):
                if not obs.key_valid[i, q]:
                    continue
                o = A[h, q] @ vals
                per_query.append(torch.stack([A[h, q, j] / (1 - A[h, q, j]) * (Wh @ (o - vals[j])).norm()
                                              for j in range(P)]))
            ref = torch.stack(per_query).amax(0)
            torch.testing.assert_close(got[i, h][real].double(), ref[real], rtol=1e-4, atol=1e-7)


def test_worst_case_is_refused_in_after_mode():
    with pytest.raises(ValueError, match="temporal='max' needs metric_mode='before'"):
        restkv.configure(tiny_model(), method="restkv", temporal="max")
