"""Compactor (kvpress 0.5.5's ``CompactorPress``) against a float64 loop of its blend: the leverage
and non-causal attention loops run on the tokens between the protected ones, blended, the protected
tokens above."""

from __future__ import annotations

import pytest
import torch
from test_methods_kvpress import case, check, leverage_loops, noncausal_loops, scores_of


def compactor_loops(
    q,
    k,
    v,
    pos,
    P,
    budget,
    sinks=8,
    recent=4,
    dimension=48,
    seed=0,
    layer=1,
    size=256,
    blending=None,
):
    """[b, Hkv, P] float64: ``blending * leverage + attention`` of the unprotected real tokens
    (each loop's statistics over them alone), the protected tokens at the sample's largest score
    plus 1."""
    b, _, n, _ = k.shape
    inner = pos.clone()
    for i in range(b):
        for j in range(n):
            if 0 <= pos[i, j] < sinks or j >= n - recent:
                inner[i, j] = -1
    lev = leverage_loops(k, inner, P, dimension, seed, layer)
    attention = noncausal_loops(q, k, v, inner, P, size)
    out = torch.zeros_like(lev)
    for i in range(b):
        real = int((pos[i] >= 0).sum())
        weight = max(0.0, 1 - budget / real) if blending is None else blending
        s = weight * lev[i] + attention[i]
        scored = [j for j in range(P) if inner[i, j] >= 0]
        top = max(float(s[h, j]) for h in range(s.shape[0]) for j in scored)
        for j in range(P):
            out[i, :, j] = top + 1 if pos[i, j] >= 0 and inner[i, j] < 0 else s[:, j]
    return out


@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(blending=0.35, attention_chunk=7, sketch_dimension=5, sketch_seed=3),
        dict(sink_tokens=0, recent_tokens=0, attention_chunk=16),
        dict(sink_tokens=3, recent_tokens=6, blending=2.0),
    ],
)
def test_compactor_equals_float64_loops(knobs):
    obs, q, k, v, pos = case(n=36, pad=(0, 5), window=2)
    got = scores_of(obs, method="compactor", **knobs)
    ref = compactor_loops(
        q,
        k,
        v,
        pos,
        obs.prefix_len,
        obs.budget,
        sinks=knobs.get("sink_tokens", 8),
        recent=knobs.get("recent_tokens", 4),
        dimension=knobs.get("sketch_dimension", 48),
        seed=knobs.get("sketch_seed", 0),
        layer=obs.layer,
        size=knobs.get("attention_chunk", 256),
        blending=knobs.get("blending"),
    )
    check(got, ref, pos, obs.prefix_len, tol=1e-4)


def test_the_default_blending_follows_the_budget():
    """blending=None is the compression ratio: the scores change with the budget, and equal the
    explicit ratio's."""
    obs, *_ = case(n=36, pad=(0, 0), window=2)
    ratio = 1 - obs.budget / 36
    torch.testing.assert_close(
        scores_of(obs, method="compactor"), scores_of(obs, method="compactor", blending=ratio)
    )
    wide = scores_of(obs, method="compactor")
    obs.budget = 30
    obs.memo.clear()
    assert not torch.allclose(wide, scores_of(obs, method="compactor"))


def test_a_negative_blending_is_refused():
    with pytest.raises(ValueError, match="blending"):
        scores_of(case()[0], method="compactor", blending=-0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_give_finite_float32_scores(dtype):
    obs, *_ = case(n=60, dtype=dtype)
    obs.queries, obs.keys = obs.queries * 30, obs.keys * 30
    got = scores_of(obs, method="compactor")
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
