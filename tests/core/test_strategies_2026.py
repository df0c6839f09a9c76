"""CriticalKV and ChunkKV selection against loops over their definitions; knob checks; RoPE capture on models."""

from __future__ import annotations

import pytest
import torch
from helpers import generate, prompt, sweep_equals_separate_runs, tiny_model
from test_methods_2026 import case

import restkv
from restkv.scoring import observe
from restkv.eviction.plans import plan_layers
from restkv.integration.attachment import attached
from restkv.strategies.budgets import adakv_budgets
from restkv.strategies.chunks import chunk_order
from restkv.config import CompressionConfig
from restkv.eviction.select import head_scores, select


def kept_sets(obs, **knobs):
    """Per (sample, head) the set of kept prefix indices, and the config."""
    cfg = CompressionConfig(max_capacity_prompt=obs.budget, window_size=obs.window, **knobs)
    kept = select(obs, cfg)
    P = obs.prefix_len
    first_real = (~obs.key_valid).sum(-1)
    sets = [[{int(p + first_real[i]) for p in row if p >= 0 and p + first_real[i] < P} for row in kept.positions[i]]
            for i in range(kept.positions.shape[0])]
    return sets, cfg


def value_l1_loops(v, W, hq):
    """mean over each GQA group of ||W_O^h v_n||_1 [b, Hkv, n], float64 loops."""
    b, hkv, n, d = v.shape
    g = hq // hkv
    out = torch.zeros(b, hkv, n, dtype=torch.float64)
    for i in range(b):
        for kv in range(hkv):
            for r in range(g):
                h = kv * g + r
                for j in range(n):
                    out[i, kv, j] += sum(abs(W[c, h * d: (h + 1) * d] @ v[i, kv, j]) for c in range(W.shape[0])) / g
    return out


def critical_loops(scores, norms, sizes, window, ratio, eps):
    """Kept index sets: each head's top n1 by score, then the best (s + eps) * norm up to its size."""
    out = []
    for i in range(scores.shape[0]):
        row = []
        for h in range(scores.shape[1]):
            s, K = scores[i, h].tolist(), int(sizes[i, h])
            n1 = min(K, max(0, int(ratio * (K + window)) - window))
            real = [j for j in range(len(s)) if s[j] != float("-inf")]
            first = sorted(real, key=lambda j: -s[j])[:n1]
            rest = sorted((j for j in real if j not in first), key=lambda j: -(s[j] + eps) * float(norms[i, h, j]))
            row.append(set(first) | set(rest[: K - n1]))
        out.append(row)
    return out


@pytest.mark.parametrize("knobs", [dict(method="criticalkv"), dict(method="critical_adakv"),
                                   dict(method="restkv", critical=True, first_stage_ratio=0.8, critical_epsilon=0.01),
                                   dict(method="snapkv", critical=True, first_stage_ratio=0.3, critical_epsilon=1.0),
                                   dict(method="keydiff", critical=True, head_budget="adakv", floor=0.0)])
def test_critical_two_stages_equal_loops(knobs, monkeypatch):
    monkeypatch.setattr(observe, "PROJECTION_BLOCK", 40)  # several blocks of positions
    obs, _, _, v, W, _ = case(n=30, pad=(0, 4), window=4, budget=14, seed=7)
    got, cfg = kept_sets(obs, **knobs)
    scores = head_scores(obs, cfg)
    base = obs.budget - obs.window
    sizes = (adakv_budgets(scores, base, cfg.floor, cfg.normalize) if cfg.head_budget == "adakv"
             else torch.full(scores.shape[:2], base))
    ref = critical_loops(scores.double(), value_l1_loops(v, W.double(), 4), sizes, obs.window,
                         cfg.first_stage_ratio, cfg.critical_epsilon)
    assert got == ref
    plain = {k: v for k, v in knobs.items() if k not in ("critical", "first_stage_ratio", "critical_epsilon")}
    assert kept_sets(obs, **plain, critical=False)[0] != got, "the second stage changes the kept set"


def test_l2_value_norm_is_the_exact_projected_norm():
    obs, _, _, v, W, _ = case(n=20, pad=(0, 0))
    got = obs.projected_value_norms("l2").double()
    for h in range(4):
        ref = (v[:, h // 2, :16] @ W[:, h * 8: (h + 1) * 8].T).norm(dim=-1)
        torch.testing.assert_close(got[:, h], ref, rtol=1e-5, atol=1e-6)


def chunk_loops(scores, positions, size, keep):
    """Kept index sets: chunks of ``size`` positions by the mean of the head-summed score, whole, then the
    next chunk's best entries by each head's score."""
    out = []
    for i in range(scores.shape[0]):
        chunks = {}
        for j, p in enumerate(positions[i].tolist()):
            if p >= 0:
                chunks.setdefault(p // size, []).append(j)
        mean = {c: sum(float(scores[i, :, j].sum()) for j in js) / len(js) for c, js in chunks.items()}
        ranked = sorted(chunks, key=lambda c: -mean[c])
        row = []
        for h in range(scores.shape[1]):
            kept = []
            for c in ranked:
                kept += sorted(chunks[c], key=lambda j: -float(scores[i, h, j]))[: keep - len(kept)]
            row.append(set(kept))
        out.append(row)
    return out


@pytest.mark.parametrize("size,budget,pad", [(5, 14, (0, 3)), (4, 12, (0, 0)), (7, 20, (2, 6)), (1, 10, (0, 1))])
def test_chunks_equal_loops(size, budget, pad):
    obs, *_ = case(n=36, pad=pad, window=4, budget=budget, seed=11)
    got, cfg = kept_sets(obs, method="chunkkv", chunk_size=size)
    ref = chunk_loops(head_scores(obs, cfg), obs.positions[:, : obs.prefix_len], size, budget - 4)
    assert got == ref
    whole = [sum(1 for c in range(pad[0], 32 - size + 1, size) if set(range(c, c + size)) <= s) for s in got[0]]
    assert min(whole) >= (budget - 4) // size - 1, "whole chunks are kept"


def test_a_partial_chunk_is_ranked_by_its_mean():
    """Chunks [0, 3), [3, 6), [6]: means 0.5, 0.4, 0.9 (sums 1.5, 1.2, 0.9); keep 4 -> the last chunk, then chunk 0."""
    scores = torch.tensor([[[0.5, 0.6, 0.4, 0.4, 0.3, 0.5, 0.9]]])
    key = chunk_order(scores, torch.arange(7)[None], 3)
    assert set(key.topk(4).indices.flatten().tolist()) == {0, 1, 2, 6}


def test_chunk_size_zero_or_none_is_off():
    obs, *_ = case(n=30)
    for off in (0, None):
        assert kept_sets(obs, method="snapkv", chunk_size=off)[0] == kept_sets(obs, method="snapkv")[0]


@pytest.mark.parametrize("knobs,name", [
    (dict(method="criticalkv", first_stage_ratio=0.0), "first_stage_ratio"),
    (dict(method="criticalkv", first_stage_ratio=1.0), "first_stage_ratio"),
    (dict(method="snapkv", critical=True, first_stage_ratio=1.5), "first_stage_ratio"),
    (dict(method="criticalkv", critical_epsilon=-1e-4), "critical_epsilon"),
    (dict(method="criticalkv", value_norm="l3"), "value_norm"),
    (dict(method="chunkkv", chunk_size=-1), "chunk_size"),
    (dict(method="chunkkv", critical=True), "chunk_size and critical"),
    (dict(method="defensivekv", critical=True), "critical"),
    (dict(method="defensivekv", first_stage_mass=0.0), "first_stage_mass"),
    (dict(method="expected_attention", n_future_positions=0), "n_future_positions"),
    (dict(method="expected_attention", n_sink=-1), "n_sink"),
    (dict(method="expected_attention", use_vnorm=False, epsilon=0.1), "epsilon"),
    (dict(method="snapkv", first_stage_ratio=0.5), "first_stage_ratio"),
])
def test_bad_knobs_raise_naming_them_before_any_work(knobs, name):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=name):
        restkv.configure(model, **knobs)
    assert not hasattr(model, "_restkv")


def _observations(model, ids, mask=None, **knobs):
    """The RoPE each evicted layer hands its eviction step at prefill."""
    seen = []
    with attached(model, plan_layers(model, CompressionConfig(**knobs)),
                  on_prefill=lambda state, *rest: seen.append(state.rope)):
        model(ids, attention_mask=mask)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gemma3"])
def test_captured_rope_is_the_layers_own(family):
    model = tiny_model(family)
    ids = prompt(30)
    ropes = _observations(model, ids, method="expected_attention")
    assert ropes and all(r is not None for r in ropes)
    positions = torch.arange(30)[None]
    for rope in ropes:  # the rotary module called again for the prompt gives what the layer applied
        cos, sin = rope.embed(positions)
        torch.testing.assert_close(cos, rope.cos.float()), torch.testing.assert_close(sin, rope.sin.float())
        assert int(rope.next_position) == 30
    if family == "gemma3":  # the global layer's RoPE, not the sliding layers'
        local = model.model.rotary_emb(ids[..., None].float(), positions, "sliding_attention")[0]
        assert not torch.allclose(local, ropes[0].cos)


def test_future_positions_leave_a_dynamic_rope_untouched():
    model = tiny_model("llama", max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                            "rope_theta": 10000.0})
    rotary = model.model.rotary_emb
    before = (rotary.inv_freq.clone(), rotary.max_seq_len_cached)
    ids = prompt(48)
    plain, _ = generate(model, ids, n=3)
    with restkv.compressing(model, method="expected_attention", max_capacity_prompt=20, window_size=4):
        generate(model, ids, n=3)  # averages the RoPE of positions 48..559, beyond 64
    assert torch.equal(rotary.inv_freq, before[0]) and rotary.max_seq_len_cached == before[1]
    assert torch.equal(generate(model, ids, n=3)[0], plain)


NEW_METHODS = ["expected_attention", "keydiff", "criticalkv", "critical_adakv", "chunkkv", "defensivekv"]


@pytest.mark.parametrize("method", NEW_METHODS)
def test_padded_batch_equals_single_runs(method):
    model = tiny_model("llama", "sdpa")
    long, short = prompt(70, seed=2)[0], prompt(45, seed=3)[0]
    chunks = {"chunk_size": 4} if method == "chunkkv" else {}
    restkv.configure(model, method=method, max_capacity_prompt=24, window_size=6, **chunks)
    singles = []
    for seq in (long, short):
        generate(model, seq[None])
        singles.append(restkv.kept_positions(model))
    ids, mask = torch.zeros(2, 70, dtype=torch.long), torch.zeros(2, 70, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, -45:], mask[1, -45:] = short, 1
    generate(model, ids, mask)
    for b, single in enumerate(singles):
        for k, ks in zip(restkv.kept_positions(model), single):
            if k is not None:
                real = [set(row[row >= 0].tolist()) for row in k[b]]
                assert real == [set(row[row >= 0].tolist()) for row in ks[0]], (method, b)


def test_sweep_shares_the_scores_and_equals_separate_runs():
    model = tiny_model("qwen2", "sdpa")
    ids = prompt(60)
    configs = [dict(method="snapkv", max_capacity_prompt=20, window_size=4, kernel_size=5, window_reduce="mean"),
               dict(method="criticalkv", max_capacity_prompt=20, window_size=4),
               dict(method="chunkkv", max_capacity_prompt=20, window_size=4),
               dict(method="expected_attention", max_capacity_prompt=24, window_size=4, critical=True, use_vnorm=False),
               dict(method="defensivekv", max_capacity_prompt=24, window_size=4)]
    sweep_equals_separate_runs(model, ids, configs, 4)
