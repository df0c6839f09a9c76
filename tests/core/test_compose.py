"""``compose`` (kvpress's ``ComposedPress``): one method prunes, then the config's selects among
what is left, against a float64 loop of the two stages on a model; generate, decoding and the
refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import capture, generate, prompt, tiny_model

import restkv
from restkv.config import CompressionConfig

B, W, L = 16, 4, 60


def two_stages(q, k, scaling, pruned):
    """Per KV head the kept prefix positions: the ``pruned - W`` smallest key norms, then among them
    SnapKV's (pooling none, window sum, GQA mean) top B - W, the window's queries attending the
    survivors and the window. q [Hq, L, d], k [Hkv, L, d] float64."""
    hq, hkv = q.shape[0], k.shape[0]
    g = hq // hkv
    P = L - W
    out = []
    for h in range(hkv):
        norms = k[h, :P].norm(dim=-1)
        first = sorted(sorted(range(P), key=lambda j: float(norms[j]))[: pruned - W])
        keys = first + list(range(P, L))
        score = {j: 0.0 for j in first}
        for r in range(g):
            for t in range(P, L):
                seen = [j for j in keys if j <= t]
                logits = torch.stack([q[h * g + r, t] @ k[h, j] for j in seen]) * scaling
                att = torch.softmax(logits, 0)
                for a, j in zip(att.tolist(), seen):
                    if j < P:
                        score[j] += a / g
        out.append(set(sorted(first, key=lambda j: -score[j])[: B - W]))
    return out


@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_the_second_method_selects_among_what_the_first_kept(ratio):
    model = tiny_model("llama", "sdpa")
    ids = prompt(L)
    captured = capture(model, ids)
    restkv.configure(
        model,
        method="snapkv",
        pooling="none",
        max_capacity_prompt=B,
        window_size=W,
        compose="l2norm",
        compose_ratio=ratio,
    )
    model(ids)
    kept = restkv.kept_positions(model)
    pruned = max(B, int(L * (1 - ratio)))
    for layer, (q, k, scaling) in captured.items():
        ref = two_stages(q[0], k[0], scaling, pruned)
        got = [{int(p) for p in row if 0 <= p < L - W} for row in kept[layer][0]]
        assert got == ref
        assert all(set(range(L - W, L)) <= {int(p) for p in row} for row in kept[layer][0])
    restkv.detach(model)


def test_composing_changes_the_kept_set_and_generate_and_decoding_run():
    model = tiny_model("llama", "sdpa")
    ids = torch.cat([prompt(L, seed=1), prompt(L, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    restkv.configure(model, method="snapkv", max_capacity_prompt=B, window_size=W)
    plain = generate(model, ids, mask, n=5)
    alone = restkv.kept_positions(model)
    for knobs in (
        dict(),
        dict(decode_interval=3),
        dict(head_budget="adakv"),
        dict(rerotate_keys="end"),
    ):
        restkv.configure(
            model, method="snapkv", max_capacity_prompt=B, window_size=W, compose="l2norm", **knobs
        )
        tokens, logits = generate(model, ids, mask, n=5)
        assert tokens.shape == plain[0].shape and torch.isfinite(logits).all()
        if not knobs:
            assert any(not torch.equal(a, b) for a, b in zip(alone, restkv.kept_positions(model)))
    restkv.configure(
        model,
        method="snapkv",
        max_capacity_prompt=B,
        window_size=W,
        compose="l2norm",
        compose_ratio=0.0,
    )  # the first stage keeps everything: SnapKV alone
    assert torch.equal(generate(model, ids, mask, n=5)[0], plain[0])
    restkv.detach(model)


@pytest.mark.parametrize(
    "knobs,message",
    [
        (
            dict(method="snapkv", compose="snapkv", layer_budget="global"),
            "compose needs a budget per layer",
        ),
        (
            dict(method="kvzip", compose="snapkv", layer_budget="uniform"),
            "kvzip replays the prompt",
        ),
        (dict(method="snapkv", compose="kvzip"), "compose must be one of"),
        (dict(method="snapkv", compose="qfilter"), "compose must be one of"),
        (
            dict(method="snapkv", compose="l2norm", gqa_agg="none"),
            "compose needs one kept set per KV head",
        ),
        (
            dict(method="snapkv", compose_ratio=0.5),
            "compose_ratio is read by method snapkv only when compose",
        ),
        (dict(method="snapkv", compose="l2norm", compose_ratio=1.0), "compose_ratio must be in"),
    ],
)
def test_refusals(knobs, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(**knobs)


def test_the_first_method_is_checked_against_the_model():
    model = tiny_model("llama", "sdpa")  # 3 layers: LaCache's default span of 16 removes nothing
    with pytest.raises(ValueError, match="compose='lacache': span"):
        restkv.configure(model, method="snapkv", max_capacity_prompt=B, window_size=W, compose="lacache")
