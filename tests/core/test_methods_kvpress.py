"""kvpress's scorers without a trained part (CUR, Leverage, LagKV, non-causal attention) against
float64 loops written from their definitions (kvpress 0.5.5's presses), on hand-made inputs with
left padding."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rope_embed

from restkv.config import CompressionConfig
from restkv.methods import cur, leverage
from restkv.scoring.observe import Observation
from restkv.scoring.rope import Rope
from restkv.eviction.select import raw_scores, select

D = 8


def rotation(p: int, d: int = D, base: float = 10000.0) -> torch.Tensor:
    """The RoPE matrix [d, d] of position p, float64: pair (i, i + d/2) by p / base^(2i/d)."""
    R = torch.zeros(d, d, dtype=torch.float64)
    h = d // 2
    for i in range(h):
        a = p * base ** (-2 * i / d)
        R[i, i], R[i, i + h], R[i + h, i], R[i + h, i + h] = (
            math.cos(a),
            -math.sin(a),
            math.sin(a),
            math.cos(a),
        )
    return R


def case(b=2, hq=4, hkv=2, n=40, pad=(0, 7), window=3, seed=0, dtype=torch.float32, layer=1):
    """An observation with left padding ``pad`` per sample; its queries, keys (after RoPE),
    values float64,
    the positions [b, n] (-1 on padding)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, D, generator=g, dtype=torch.float64)
    k = (
        torch.randn(b, hkv, n, D, generator=g, dtype=torch.float64)
        * torch.rand(b, hkv, n, 1, generator=g)
        * 2
    )
    v = (
        torch.randn(b, hkv, n, D, generator=g, dtype=torch.float64)
        * torch.rand(b, hkv, n, 1, generator=g)
        * 2
    )
    valid = torch.ones(b, n, dtype=torch.bool)
    for i, p in enumerate(pad):
        valid[i, :p] = False
    pos = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)
    obs = Observation(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        valid,
        window=window,
        budget=12,
        scaling=D**-0.5,
        rope=Rope.of(rope_embed(D), pos.clamp_min(0)),
        layer=layer,
    )
    return obs, q, k, v, pos


def scores_of(obs, **knobs):
    cfg = CompressionConfig(max_capacity_prompt=obs.budget, window_size=obs.window, **knobs)
    return raw_scores(obs, cfg)


def check(got, ref, pos, P, tol=2e-5):
    real = (pos[:, None, :P] >= 0).expand_as(ref)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double()[real], ref[real], rtol=tol, atol=1e-6)


def zscore_loop(s, rows):
    """s [H, n] float64 over the real entries ``rows``: (s - mean) / std (unbiased, >= 1e-6)."""
    x = s[:, rows]
    return (s - x.mean()) / max(float(x.std()), 1e-6)


# --- CUR ---


def cur_loops(k, v, pos, P, sinks, kind, local, w, G=None):
    b, hkv, n, _ = k.shape
    out = torch.zeros(b, hkv, P, dtype=torch.float64)
    for i in range(b):
        rows = [j for j in range(n) if pos[i, j] >= 0]
        for h in range(hkv):

            def lev(x):
                s = {
                    j: float((x[i, h, j] if G is None else x[i, h, j] @ G).square().sum())
                    for j in rows
                }
                if local:
                    chunk = {}
                    for j in rows:
                        chunk[int(pos[i, j]) // w] = chunk.get(int(pos[i, j]) // w, 0.0) + s[j]
                    s = {j: s[j] / chunk[int(pos[i, j]) // w] for j in rows}
                return s

            k2, v2 = lev(k), lev(v)
            s = {
                j: {
                    "key": k2[j],
                    "value": v2[j],
                    "kv_avg": (k2[j] + v2[j]) / 2,
                    "kv_product": k2[j] * v2[j],
                }[kind]
                for j in rows
            }
            total = sum(s.values())
            for j in rows:
                if j < P:
                    out[i, h, j] = 1.0 if pos[i, j] < sinks else s[j] / total
    return out


@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(leverage_type="kv_avg", local_window_size=5),
        dict(leverage_type="key", use_local_approximation=False, sink_tokens=0),
        dict(leverage_type="value", use_random_leverage=True, sketch_seed=3),
    ],
)
def test_cur_equals_float64_loops(knobs):
    obs, _, k, v, pos = case()
    cfg = {
        "sink_tokens": 4,
        "leverage_type": "kv_product",
        "use_local_approximation": True,
        "local_window_size": 16,
        **knobs,
    }
    got = scores_of(obs, method="cur", **knobs)
    G = (
        cur.sketch(D, cur.SKETCH, cfg.get("sketch_seed", 0), obs.layer, "cpu").double()
        if cfg.get("use_random_leverage")
        else None
    )
    ref = cur_loops(
        k,
        v,
        pos,
        obs.prefix_len,
        cfg["sink_tokens"],
        cfg["leverage_type"],
        cfg["use_local_approximation"],
        cfg["local_window_size"],
        G,
    )
    check(got, ref, pos, obs.prefix_len)


# --- Leverage ---


def leverage_loops(k, pos, P, dimension, seed, layer):
    b, hkv, n, d = k.shape
    phi = cur.sketch(d, dimension, seed, layer, "cpu").double()
    out = torch.zeros(b, hkv, n, dtype=torch.float64)
    for i in range(b):
        rows = [j for j in range(n) if pos[i, j] >= 0]
        for h in range(hkv):
            pre = {j: rotation(int(pos[i, j])).T @ k[i, h, j] for j in rows}
            mean = sum(pre.values()) / len(rows)
            X = {j: (pre[j] - mean) @ phi for j in rows}
            G = sum(torch.outer(x, x) for x in X.values()) + 1e-2 * torch.eye(
                dimension, dtype=torch.float64
            )
            inv = torch.linalg.inv(G)
            for j in rows:
                out[i, h, j] = X[j] @ inv @ X[j]
        out[i] = zscore_loop(out[i], rows)
    return out[..., :P]


@pytest.mark.parametrize("knobs", [dict(), dict(sketch_dimension=5, sketch_seed=7)])
def test_leverage_equals_float64_loops(knobs):
    obs, _, k, _, pos = case()
    cfg = {"sketch_dimension": 48, "sketch_seed": 0, **knobs}
    got = scores_of(obs, method="leverage", **knobs)
    ref = leverage_loops(
        k, pos, obs.prefix_len, cfg["sketch_dimension"], cfg["sketch_seed"], obs.layer
    )
    check(got, ref, pos, obs.prefix_len, tol=1e-4)


def test_leverage_is_the_statistical_leverage_when_the_sketch_keeps_every_direction():
    """With more sketch columns than d and keys large against the jitter, the scores are the
    leverage of the
    centred keys before RoPE: they sum to d per head, and an outlier key has the largest."""
    obs, _, k, _, pos = case(b=1, hkv=2, n=30, pad=(0,))
    obs.keys = obs.keys * 100
    obs.keys[0, 0, 11] *= 8  # an outlier (its direction unchanged)
    s = leverage.leverage(
        obs,
        64,
        0,
    )
    torch.testing.assert_close(s.sum(-1), torch.full((1, 2), float(D)), rtol=1e-3, atol=0)
    assert int(s[0, 0].argmax()) == 11


# --- LagKV ---


def lagkv_loops(k, v, pos, P, sinks, lag, cross):
    b, hkv, n, d = k.shape
    out = torch.zeros(b, hkv, P, dtype=torch.float64)
    for i in range(b):
        rows = [j for j in range(n) if pos[i, j] >= 0]
        L = len(rows)
        for h in range(hkv):
            s = {}
            if L < sinks + 2 * lag:
                for t, j in enumerate(rows):
                    s[j] = 1.0 if t < sinks else (t - sinks) / (L - sinks)
            else:
                m = (L - sinks) // lag
                for t, j in enumerate(rows):
                    if t < sinks or t >= sinks + (m - 1) * lag:
                        s[j] = 1.0
                for part in range(m - 1):
                    own = rows[sinks + part * lag : sinks + (part + 1) * lag]
                    ref = rows[sinks + (part + 1) * lag : sinks + (part + 2) * lag]
                    both = torch.zeros(lag, dtype=torch.float64)
                    for x in (k, v):
                        lo = torch.stack([x[i, h, j] for j in ref]).min(0).values
                        hi = torch.stack([x[i, h, j] for j in ref]).max(0).values
                        spread = torch.tensor(
                            [float(((x[i, h, j] - lo) / (hi - lo)).std()) for j in own]
                        )
                        both += torch.softmax(spread.double(), 0) / 2
                    if not cross:
                        both = (
                            torch.tensor(
                                [sum(float(o) < float(x) for o in both) for x in both],
                                dtype=torch.float64,
                            )
                            / lag
                        )
                    for t, j in enumerate(own):
                        s[j] = float(both[t])
            for j in rows:
                if j < P:
                    out[i, h, j] = s[j]
    return out


@pytest.mark.parametrize(
    "knobs", [dict(), dict(cross_scoring=True), dict(lag_size=4, sink_tokens=0), dict(lag_size=20)]
)
def test_lagkv_equals_float64_loops(knobs):
    obs, _, k, v, pos = case(n=50, pad=(0, 9))
    cfg = {"sink_tokens": 4, "lag_size": 6, "cross_scoring": False, **knobs}
    got = scores_of(obs, method="lagkv", **{"lag_size": 6, **knobs})
    ref = lagkv_loops(
        k, v, pos, obs.prefix_len, cfg["sink_tokens"], cfg["lag_size"], cfg["cross_scoring"]
    )
    check(got, ref, pos, obs.prefix_len)


# --- non-causal chunked attention ---


def noncausal_loops(q, k, v, pos, P, size):
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(b, hkv, n, dtype=torch.float64)
    for i in range(b):
        rows = [j for j in range(n) if pos[i, j] >= 0]
        A = torch.zeros(hq, n, dtype=torch.float64)
        for h in range(hq):
            for c in range(0, len(rows), size):
                chunk = rows[c : c + size]
                for t in chunk:
                    a = torch.softmax(torch.stack([q[i, h, t] @ k[i, h // g, j] for j in chunk]), 0)
                    for j, w in zip(chunk, a):
                        A[h, j] += w
        s = torch.zeros(hkv, n, dtype=torch.float64)
        for h in range(hkv):
            for j in rows:
                s[h, j] = A[h * g : (h + 1) * g, j].mean() * v[i, h, j].norm()
        pooled = torch.zeros_like(s)
        for j in range(n):
            pooled[:, j] = sum(s[:, o] for o in (j - 1, j, j + 1) if 0 <= o < n) / 3
        out[i] = zscore_loop(pooled, rows)
    return out[..., :P]


@pytest.mark.parametrize("size", [256, 7, 16])
def test_noncausal_equals_float64_loops(size):
    obs, q, k, v, pos = case(n=36, pad=(0, 5))
    got = scores_of(obs, method="noncausal", attention_chunk=size)
    ref = noncausal_loops(q, k, v, pos, obs.prefix_len, size)
    check(got, ref, pos, obs.prefix_len, tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["cur", "leverage", "lagkv", "noncausal"])
def test_low_precision_inputs_give_finite_float32_scores(dtype, method):
    obs, *_ = case(n=60, dtype=dtype)
    obs.queries, obs.keys = obs.queries * 30, obs.keys * 30
    extra = {"lag_size": 8} if method == "lagkv" else {}
    got = scores_of(obs, method=method, **extra)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()


# --- the threshold budget (DMS) and SimLayerKV ---


def kept_sets(kept) -> list:
    """Kept positions [b, H, K] -> per sample, per head, the set of kept positions."""
    return [[{int(p) for p in head if p >= 0} for head in sample] for sample in kept.positions]


@pytest.mark.parametrize("threshold,budget", [(-2.5, 10**6), (-3.2, 29), (-2.5, 9)])
def test_the_threshold_budget_keeps_the_entries_scoring_at_least_the_threshold(threshold, budget):
    """DMS's rule on L2Norm's scores (-||k||): a head keeps its prefix entries scoring >= threshold
    (at most
    budget - window of them, the best) and the window, also when the prompt is within the budget."""
    obs, _, k, _, pos = case(n=30, pad=(0, 4), window=3)
    obs.budget = budget
    cfg = CompressionConfig(
        method="l2norm",
        max_capacity_prompt=budget,
        window_size=3,
        head_budget="threshold",
        threshold=threshold,
    )
    got = kept_sets(select(obs, cfg))
    P = obs.prefix_len
    for i in range(2):
        for h in range(2):
            real = [j for j in range(P) if pos[i, j] >= 0]
            above = sorted(
                (j for j in real if -float(k[i, h, j].norm()) >= threshold),
                key=lambda j: float(k[i, h, j].norm()),
            )[: budget - 3]
            ref = {int(pos[i, j]) for j in above} | {int(pos[i, j]) for j in range(P, 30)}
            assert got[i][h] == ref
    sizes = [len(s) for sample in got for s in sample]
    assert budget == 9 or min(sizes) < max(sizes) < 29, "heads keep different numbers of entries"
    if budget == 9:
        assert max(sizes) == 9


def test_the_threshold_budget_needs_a_threshold():
    with pytest.raises(ValueError, match="threshold"):
        CompressionConfig(method="snapkv", head_budget="threshold")


def simlayerkv_loops(q, k, pos, valid, lazy_threshold, n_last, n_recent, n_initial):
    """Per sample, the positions a layer keeps (SimLayerKVPress on the sample's real tokens): its
    last n_last queries' softmax attention (causal), averaged, summed over the first n_initial and
    the n_recent before the last n_last keys; lazy above the threshold: the first n_initial and the
    last n_recent - n_last."""
    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    out = []
    for i in range(b):
        rows = [j for j in range(n) if valid[i, j]]
        L = len(rows)
        a = torch.zeros(L, dtype=torch.float64)
        for h in range(hq):
            for t in range(L - n_last, L):
                z = torch.stack(
                    [q[i, h, rows[t]] @ k[i, h // g, rows[j]] * d**-0.5 for j in range(t + 1)]
                )
                a[: t + 1] += torch.softmax(z, 0) / (hq * n_last)
        a = a[: L - n_last]
        mass = float(a[:n_initial].sum() + a[-n_recent:].sum())
        if L <= n_initial + n_recent + n_last or mass <= lazy_threshold:
            out.append(set(range(L)))
        else:
            out.append(set(range(n_initial)) | set(range(L - n_recent + n_last, L)))
    return out


@pytest.mark.parametrize(
    "knobs",
    [
        dict(lazy_threshold=0.3, n_recent=10),
        dict(lazy_threshold=0.95, n_recent=10),
        dict(lazy_threshold=0.2, n_recent=6, n_last=3, n_initial=2),
        dict(lazy_threshold=0.0, n_recent=40),
    ],
)
def test_simlayerkv_keeps_what_simlayerkvpress_keeps(knobs):
    obs, q, k, _, pos = case(n=36, pad=(0, 6), window=1, seed=2)
    obs.budget = 10**6  # caps nothing: a prompt within the budget is thresholded too
    cfg = CompressionConfig(method="simlayerkv", max_capacity_prompt=10**6, window_size=1, **knobs)
    got = kept_sets(select(obs, cfg))
    full = {"lazy_threshold": 0.9, "n_last": 1, "n_recent": 1024, "n_initial": 4, **knobs}
    ref = simlayerkv_loops(q, k, pos, obs.key_valid, **full)
    for i in range(2):
        assert all(head == ref[i] for head in got[i])


def test_simlayerkv_decides_laziness_per_sample():
    obs, *_ = case(n=36, pad=(0, 6), window=1, seed=2)
    obs.budget = 10**6
    cfg = CompressionConfig(
        method="simlayerkv",
        max_capacity_prompt=10**6,
        window_size=1,
        n_recent=10,
        lazy_threshold=0.0,
    )
    sizes = [len(s[0]) for s in kept_sets(select(obs, cfg))]
    assert sizes == [4 + 9, 4 + 9]
    obs.queries[1] *= 0  # uniform attention: 14 of 30 keys' mass on the ends
    cfg = CompressionConfig(
        method="simlayerkv",
        max_capacity_prompt=10**6,
        window_size=1,
        n_recent=10,
        lazy_threshold=0.47,
    )
    lazy = [len(s[0]) < 30 for s in kept_sets(select(obs, cfg))]
    assert lazy[1] is False


# --- Q-Filters ---


def qfilter_loops(queries, hkv):
    """[Hkv, d] float64: per query head the top eigenvector of Q^T Q, turned towards the side where
    most queries project, averaged over each GQA group."""
    hq, _, d = queries.shape
    out = torch.zeros(hkv, d, dtype=torch.float64)
    for h in range(hq):
        q = queries[h].double()
        v = torch.linalg.eigh(q.T @ q).eigenvectors[:, -1]
        if sum(float(x @ v) > 0 for x in q) <= len(q) / 2:
            v = -v
        out[h // (hq // hkv)] += v / (hq // hkv)
    return out


def test_qfilters_are_the_oriented_principal_directions_of_the_queries():
    from restkv.methods.qfilter import filters_from_queries

    g = torch.Generator().manual_seed(0)
    q = (
        torch.randn(4, 200, D, generator=g, dtype=torch.float64)
        + torch.randn(4, 1, D, generator=g) * 2
    )
    torch.testing.assert_close(
        filters_from_queries(q, 2).double(), qfilter_loops(q, 2), rtol=1e-5, atol=1e-6
    )


def test_qfilter_scores_project_the_keys_on_the_filters():
    obs, q, k, _, pos = case()
    P = obs.prefix_len
    obs.data = torch.randn(2, D, generator=torch.Generator().manual_seed(1))
    got = scores_of(obs, method="qfilter")
    ref = torch.einsum("bhnd,hd->bhn", k[..., :P, :], obs.data.double())
    check(got, ref, pos, P)
    obs.data = None  # a hand-made observation: the filters of its own (real) queries
    obs.memo = {}
    q = q + 3 * torch.randn(
        1, 4, 1, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    obs.queries = q.float()  # a dominant direction per head, as real queries have
    real = torch.cat([q[i, :, pos[i] >= 0] for i in range(2)], 1)
    ref = torch.einsum("bhnd,hd->bhn", k[..., :P, :], qfilter_loops(real, 2))
    check(scores_of(obs, method="qfilter"), ref, pos, P, tol=1e-4)


def test_qfilters_of_a_model_are_those_of_its_queries_on_the_essays():
    """Every calibration position is sampled (2 windows of 256 < 3000 samples): the filters are
    those of
    all the model's queries after RoPE, captured here from q_proj and the model's rotary module."""
    from helpers import tiny_model, tiny_tokenizer
    from transformers import AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from restkv.integration.qfilters import calibration_ids, model_filters

    model = tiny_model("llama", "sdpa")
    got = model_filters(model, tiny_tokenizer(), 2, 256)
    ids = calibration_ids(AutoTokenizer.from_pretrained(tiny_tokenizer()), 10**6, 2, 256)
    layers = model.model.layers
    heads, d = model.config.num_attention_heads, model.config.head_dim
    queries = [[] for _ in layers]
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(
            lambda mod, args, out, i=i: queries[i].append(out.view(1, -1, heads, d).transpose(1, 2))
        )
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        for row in ids:
            model(input_ids=row[None])
    for h in hooks:
        h.remove()
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(ids.shape[1])[None])
    for i in range(len(layers)):
        q = torch.cat([apply_rotary_pos_emb(x, x, cos, sin)[0] for x in queries[i]], 2)[
            0
        ]  # [Hq, N, d]
        ref = qfilter_loops(q, model.config.num_key_value_heads)
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-4, atol=1e-5)
    assert model_filters(model, tiny_tokenizer(), 2, 256) is got  # computed once per model


def test_a_qfilter_file_is_read_and_checked(tmp_path):
    from helpers import tiny_model

    import restkv

    model = tiny_model("llama", "sdpa")
    filters = torch.randn(3, 2, model.config.head_dim)
    torch.save(filters, tmp_path / "f.pt")
    cfg = restkv.configure(model, method="qfilter", qfilter_file=str(tmp_path / "f.pt"))
    assert torch.equal(torch.stack([s.plan.data for s in model._restkv.states]), filters)
    restkv.detach(model)
    torch.save(filters[:2], tmp_path / "g.pt")
    with pytest.raises(ValueError, match="qfilter_file .*shape"):
        restkv.configure(model, method="qfilter", qfilter_file=str(tmp_path / "g.pt"))
    with pytest.raises(ValueError, match="qfilter_file not found"):
        restkv.configure(model, method="qfilter", qfilter_file=str(tmp_path / "none.pt"))
    with pytest.raises(ValueError, match="tokenizer"):  # no checkpoint to read a tokenizer from
        restkv.configure(model, method="qfilter")
    assert cfg.method == "qfilter"
