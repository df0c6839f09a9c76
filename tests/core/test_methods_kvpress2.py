"""kvpress's Finch, KVCompose, EntropyGatedChunkKV and KVgrad against float64 loops written from
their definitions."""

from __future__ import annotations

import math

import pytest
import torch
from test_methods_2026 import case, scores_of, window_attention_loops

from restkv.strategies.budgets import global_sizes
from restkv.config import CompressionConfig
from restkv.methods import kvcompose, kvgrad
from restkv.scoring import observe
from restkv.scoring.observe import Observation, wo_factor


def finch_loops(obs, k, pos, normalize=True):
    """[b, Hq, P] float64: mean over the window queries of their attention, each row times the
    query's position (counted from the first real token), as kvpress FinchPress.score."""
    b, hq, n, _ = obs.queries.shape
    w, P = obs.window, obs.prefix_len
    A = window_attention_loops(obs.queries.double(), k, obs.key_valid, w)
    out = torch.zeros(b, hq, P, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            for t in range(w):
                weight = float(pos[i, n - w + t]) if normalize else 1.0
                out[i, h] += A[i, h, t, :P] * weight / w
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_finch_equals_float64_loops(normalize):
    obs, _, k, _, _, pos = case(n=24, pad=(0, 6), window=5, budget=12, seed=2)
    got = scores_of(obs, method="finch", normalize_scores=normalize)
    ref = finch_loops(obs, k, pos, normalize)
    real = (pos[:, None, : obs.prefix_len] >= 0).expand_as(ref)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double()[real], ref[real], rtol=2e-5, atol=1e-8)


def test_finch_normalization_changes_the_ranking():
    """The scaling is not a constant: it reweights the window queries."""
    obs, *_ = case(n=40, pad=(0, 0), window=8, budget=12, seed=4)
    on = scores_of(obs, method="finch")
    off = scores_of(obs, method="finch", normalize_scores=False)
    assert not torch.allclose(
        on / on.sum(-1, keepdim=True), off / off.sum(-1, keepdim=True), rtol=1e-3
    )


# --- KVCompose ---


def pass_observation(L=14, hq=4, hkv=2, seed=0):
    """A second reading's observation: queries [1, Hq, L, d] of positions L..2L-1 over keys
    [1, Hkv, 2L, d]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, L, 8, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(1, hkv, 2 * L, 8, generator=g, dtype=torch.float64)
    obs = Observation(
        q.float(),
        k.float(),
        k.float(),
        torch.ones(1, 2 * L, dtype=torch.bool),
        window=L,
        budget=2 * L,
        scaling=8**-0.5,
    )
    return obs, q, k


def kvcompose_loops(q, k, agg_task="max", agg_group="mean", add_mean=True):
    """[1, Hkv, L] float64: kvpress KVComposePress.compute_scores + enhance_scores, from the
    attention of the second reading's queries (position L + t sees keys 0..L + t) over the first L
    keys."""
    _, hq, L, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    per_head = torch.zeros(hq, L, dtype=torch.float64)
    for h in range(hq):
        rows = []
        for t in range(L):
            z = torch.stack([q[0, h, t] @ k[0, h // g, j] * d**-0.5 for j in range(L + t + 1)])
            rows.append(torch.softmax(z, 0)[:L])
        rows = torch.stack(rows)
        per_head[h] = rows.amax(0) if agg_task == "max" else rows.mean(0)
    out = torch.zeros(hkv, L, dtype=torch.float64)
    for kv in range(hkv):
        group = per_head[kv * g : (kv + 1) * g]
        out[kv] = group.mean(0) if agg_group == "mean" else group.amax(0)
    return (out + out.mean(0, keepdim=True) if add_mean else out)[None]


@pytest.mark.parametrize(
    "knobs", [dict(), dict(agg_task="mean", agg_group="max", add_mean_across_heads=False)]
)
def test_kvcompose_scores_equal_float64_loops(knobs, monkeypatch):
    monkeypatch.setattr(observe, "QUERY_BLOCK", 3)  # blocks of 3 queries
    obs, q, k = pass_observation()
    got = scores_of(obs, method="kvcompose", **knobs)
    ref = kvcompose_loops(
        q,
        k,
        knobs.get("agg_task", "max"),
        knobs.get("agg_group", "mean"),
        knobs.get("add_mean_across_heads", True),
    )
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=1e-8)


def composite_counts_loops(scores, n_kept, agg_head="mean", lower_bound=0, structured=True):
    """kvpress KVComposePress.compute_important_per_layer on per-layer scores [Hkv, P] (float64):
    entries kept per (layer, head)."""
    layers, hkv, P = len(scores), scores[0].shape[0], scores[0].shape[1]
    if not structured:
        flat = torch.stack([s.sort(-1, descending=True).values for s in scores])  # [layers, Hkv, P]
        flat[..., :lower_bound] += 1e9
        top = flat.reshape(-1).topk(n_kept * hkv).indices // P
        return torch.bincount(top, minlength=layers * hkv).view(layers, hkv)
    comp = torch.zeros(layers, P, dtype=torch.float64)
    for layer in range(layers):
        ranked = scores[layer].sort(-1, descending=True).values
        comp[layer] = ranked.mean(0) if agg_head == "mean" else ranked.amax(0)
    comp[:, :lower_bound] += 1e9
    comp[0] = comp.max(0).values
    top = comp.reshape(-1).topk(n_kept).indices // P
    return torch.bincount(top, minlength=layers)[:, None].expand(layers, hkv)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(agg_head="max"),
        dict(keep_token_lower_bound=5),
        dict(structured=False),
        dict(structured=False, keep_token_lower_bound=4),
    ],
)
def test_kvcompose_layer_counts_equal_the_reference_composite_tokens(knobs):
    """``global_sizes`` gives every head of a layer the reference's count for it."""
    g = torch.Generator().manual_seed(1)
    layers, hkv, P, per_head = 4, 3, 30, 7
    scores = [
        torch.rand(hkv, P, generator=g, dtype=torch.float64) ** (layer + 1)
        for layer in range(layers)
    ]
    cfg = CompressionConfig(
        method="kvcompose", max_capacity_prompt=per_head + 1, window_size=1, **knobs
    )
    sizes = kvcompose.global_sizes(
        [s[None].float() for s in scores], layers * hkv * per_head, cfg.score_knobs(), global_sizes
    )
    got = torch.stack(sizes)[:, 0]  # [layers, Hkv]
    ref = composite_counts_loops(
        scores,
        layers * per_head,
        knobs.get("agg_head", "mean"),
        knobs.get("keep_token_lower_bound", 0),
        knobs.get("structured", True),
    )
    assert torch.equal(got, ref), (got, ref)
    if knobs.get("structured", True):
        assert len(set(got[:, 0].tolist())) > 1, "layers keep different counts"


def test_kvcompose_keeps_what_a_second_reading_attends_to_on_a_model():
    """End to end on a tiny model: the kept sets are each head's top entries by the attention of the
    prompt's second copy (one eager forward of [prompt, prompt]), in the counts of the reference's
    composite tokens."""
    from helpers import prompt, tiny_model

    import restkv

    model = tiny_model("llama", "eager", seed=2)
    L, B = 40, 12
    ids = prompt(L, seed=5)
    with torch.no_grad():
        attn = model(
            torch.cat([ids, ids], 1), output_attentions=True
        ).attentions  # per layer [1, Hq, 2L, 2L]
    scores = []
    for a in attn:
        a = a[0, :, L:, : L - 1].double().amax(1)  # [Hq, P]: the prefix before the window of 1
        s = a.view(2, 3, -1).mean(1)
        scores.append(s + s.mean(0, keepdim=True))
    counts = composite_counts_loops(scores, 3 * (B - 1))
    with restkv.compressing(model, method="kvcompose", max_capacity_prompt=B, window_size=1):
        model(ids)
        kept = restkv.kept_positions(model)
    for layer, (s, held) in enumerate(zip(scores, kept)):
        for h in range(2):
            mine = held[0, h][held[0, h] >= 0]
            assert mine.numel() == int(counts[layer, h]) + 1
            top = s[h].topk(int(counts[layer, h])).indices
            assert set(mine.tolist()) == set(top.tolist()) | {L - 1}


# --- EntropyGatedChunkKV ---


def entropy_gated_loops(scores, chunk_len, low, budget):
    """kvpress EntropyGatedChunkKVPress.compress's kept positions, in plain Python floats (math), on
    one head's scores (a list)."""
    n, eps = len(scores), 1e-8
    bounds = [(s, min(s + chunk_len, n)) for s in range(0, n, chunk_len)]
    chunk_scores, entropies = [], []
    for s, e in bounds:
        x = scores[s:e]
        chunk_scores.append(sum(x) / len(x))
        if len(x) == 1:
            entropies.append(0.0)
            continue
        shift = min(min(x), 0.0)
        y = [v - shift for v in x]
        p = [v / (sum(y) + eps) for v in y]
        h = -sum(q * math.log(q + eps) for q in p)
        entropies.append(min(max(h / math.log(len(x)), 0.0), 1.0))

    def lower_median(v):
        return sorted(v)[(len(v) - 1) // 2]

    high = [c >= lower_median(chunk_scores) for c in chunk_scores]
    spiky = [e < lower_median(entropies) for e in entropies]
    keep, left = set(), budget
    for c in sorted(range(len(bounds)), key=lambda i: -chunk_scores[i]):
        if left <= 0:
            break
        s, e = bounds[c]
        k = min(e - s, left)
        if high[c] and spiky[c]:
            k = min(k, low)
        keep |= set(sorted(range(s, e), key=lambda j: -scores[j])[:k])
        left -= k
    rest = sorted((j for j in range(n) if j not in keep), key=lambda j: -scores[j])
    return keep | set(rest[:left])


@pytest.mark.parametrize(
    "P,chunk_len,low,budget,pad,signed",
    [
        (57, 10, 4, 20, 0, False),
        (60, 10, 4, 33, 3, False),
        (41, 6, 2, 15, 0, True),
        (50, 10, 4, 45, 5, False),
    ],
)
def test_entropy_gated_chunks_equal_the_reference_greedy(P, chunk_len, low, budget, pad, signed):
    from restkv.strategies.chunks import chunk_order

    g = torch.Generator().manual_seed(P + budget)
    raw = torch.rand(P, generator=g, dtype=torch.float64) ** 4  # spiky and flat chunks
    raw[2 * chunk_len + 1] += 3.0  # a spiky chunk of the best: the gate keeps part of it
    raw = raw - 0.3 if signed else raw
    scores = torch.full((1, 1, P + pad), float("-inf"))
    scores[0, 0, pad:] = raw.float()
    positions = torch.cat([torch.full((pad,), -1), torch.arange(P)])[None]
    key = chunk_order(scores, positions, chunk_len, low)
    got = set((key[0, 0].topk(budget).indices - pad).tolist())
    ref = entropy_gated_loops(raw.float().double().tolist(), chunk_len, low, budget)
    assert got == ref
    plain = set(
        (chunk_order(scores, positions, chunk_len)[0, 0].topk(budget).indices - pad).tolist()
    )
    assert plain != ref, "the gate changes what is kept"


def test_entropy_gate_needs_a_smaller_length_than_the_chunks():
    with pytest.raises(ValueError, match="low_entropy_chunk_length"):
        CompressionConfig(
            method="chunkkv", max_capacity_prompt=64, window_size=8, low_entropy_chunk_length=20
        )
    with pytest.raises(ValueError, match="low_entropy_chunk_length"):
        CompressionConfig(
            method="snapkv", max_capacity_prompt=64, window_size=8, low_entropy_chunk_length=2
        )


# --- KVgrad ---


def test_kvgrad_scores_equal_float64_loops():
    """``max_p A_pc g_p ||W_O^h v_c||`` per query head on a pass's observation, sinks above all."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, sinks, chunk, r = 4, 2, 8, 2, 9, 6
    n = sinks + chunk + r
    q = torch.randn(1, hq, r, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
    W = torch.randn(12, hq * d, generator=g, dtype=torch.float64)
    weights = torch.rand(1, r, generator=g, dtype=torch.float64) + 0.1
    obs = Observation(
        q.float(),
        k.float(),
        v.float(),
        torch.ones(1, n, dtype=torch.bool),
        window=r,
        budget=n,
        scaling=d**-0.5,
        wo_factor=wo_factor(W.float(), hq),
        query_weights=weights.float(),
    )
    got = scores_of(obs, method="kvgrad", sink_tokens=sinks)
    P = sinks + chunk
    ref = torch.zeros(1, hq, P, dtype=torch.float64)
    for h in range(hq):
        for c in range(P):
            vnorm = (W[:, h * d : (h + 1) * d] @ v[0, h // 2, c]).norm()
            best = 0.0
            for p in range(r):
                z = torch.stack([q[0, h, p] @ k[0, h // 2, j] * d**-0.5 for j in range(P + p + 1)])
                best = max(best, float(torch.softmax(z, 0)[c] * weights[0, p] * vnorm))
            ref[0, h, c] = best
    assert torch.all(got[..., :sinks] == kvgrad.SINK)
    torch.testing.assert_close(got[..., sinks:].double(), ref[..., sinks:], rtol=2e-5, atol=1e-9)


def kvgrad_reference_scores(model, ids, pass_ids, sinks):
    """Per layer [Hkv, L] float64 (the max over the group) from ONE forward of [prompt | pass] with
    autograd: A the pass rows of the eager attention over the prompt (a single pass covers it all:
    the subset softmax is the full one), g_p the gradient norm of sum_p ||h_p||^2 (last layer, pass
    tokens) at each attention output."""
    L = ids.shape[1]
    outputs, last = [], {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, o: outputs.append(o))
        for layer in model.model.layers
    ]
    hooks.append(model.model.layers[-1].register_forward_hook(lambda m, a, o: last.update(h=o)))
    try:
        out = model(torch.cat([ids[0], pass_ids])[None], output_attentions=True, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    attn = [o[1] for o in outputs]
    h = last["h"][0] if isinstance(last["h"], tuple) else last["h"]
    phi = h[0, L:].double().square().sum()
    grads = torch.autograd.grad(phi, [o[0] for o in outputs])
    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    d = model.config.head_dim
    scores = []
    for layer, (a, grad) in enumerate(zip(attn, grads)):
        gnorm = grad[0, L:].double().norm(dim=-1)  # [r]
        values = out.past_key_values.layers[layer].values[0, :, :L].double()  # [Hkv, L, d]
        W = model.model.layers[layer].self_attn.o_proj.weight.double()
        per_head = torch.zeros(hq, L, dtype=torch.float64)
        for head in range(hq):
            vnorm = (values[head // (hq // hkv)] @ W[:, head * d : (head + 1) * d].T).norm(
                dim=-1
            )  # [L]
            A = a[0, head, L:, :L].double()  # [r, L]
            per_head[head] = (A * gnorm[:, None]).amax(0) * vnorm
        s = per_head.view(hkv, hq // hkv, L).amax(1)
        s[:, :sinks] = float("inf")
        scores.append(s.detach())
    return scores


def test_kvgrad_keeps_the_top_of_a_gradient_weighted_reconstruction_on_a_model():
    from helpers import SMALL_MODEL, prompt, tiny_model

    import restkv

    model = tiny_model("llama", "eager", seed=4)
    L, B, w = 40, 14, 4
    ids = prompt(L, seed=6)
    knobs = dict(SMALL_MODEL["kvgrad"], repeat_chunk=64)  # one pass covers the prompt
    cfg = CompressionConfig(method="kvgrad", max_capacity_prompt=B, window_size=w, **knobs)
    sinks, passes = kvgrad.passes(ids[0], cfg.score_knobs(), model)
    assert len(passes) == 1
    ref = [s[:, : L - w] for s in kvgrad_reference_scores(model, ids, passes[0][2], sinks)]
    flat = torch.stack(ref).reshape(-1)
    top = torch.zeros_like(flat, dtype=torch.bool)
    top[flat.topk(3 * 2 * (B - w)).indices] = True
    expected = top.view(3, 2, L - w)
    with (
        torch.inference_mode(),
        restkv.compressing(model, method="kvgrad", max_capacity_prompt=B, window_size=w, **knobs),
    ):
        model(ids)  # under inference_mode, as the runners
        kept = restkv.kept_positions(model)
    for layer in range(3):
        for h in range(2):
            mine = kept[layer][0, h]
            mine = set(mine[(mine >= 0) & (mine < L - w)].tolist())
            assert mine == set(expected[layer, h].nonzero().flatten().tolist()), (layer, h)


# --- every new method in sweep mode, with padding, and decoding on what it keeps ---


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sweep_of_the_new_methods_equals_separate_runs_with_padding(family):
    from helpers import prompt, small, tiny_model
    from test_deferred import _separate

    import restkv

    model = tiny_model(family, "sdpa")
    ids = torch.cat([prompt(64, seed=3), prompt(64, seed=4)])
    mask = torch.ones_like(ids)
    ids[1, :20], mask[1, :20] = 0, 0
    base = dict(max_capacity_prompt=20, window_size=4)
    configs = [
        small("kvcompose", **base),
        small("kvcompose", max_capacity_prompt=28, window_size=4),
        small("kvcompose", structured=False, **base),
        small("kvgrad", **base),
        small("finch", **base),
        small("entropy_gated_chunkkv", **base),
    ]
    swept = restkv.sweep(model, ids, mask, configs, 4, pad_token_id=0)
    for cfg, (tokens, kept) in zip(configs, swept):
        ref_tokens, ref_kept = _separate(model, ids, mask, cfg)
        assert torch.equal(tokens, ref_tokens), cfg
        for k, r in zip(kept, ref_kept):
            assert (k is None) == (r is None) and (k is None or torch.equal(k, r)), cfg


@pytest.mark.parametrize("method", ["kvcompose", "kvgrad"])
def test_decoding_after_the_passes_equals_a_masked_full_cache(method):
    from helpers import generate, masked_reference_logits, prompt, small, tiny_model

    import restkv

    model = tiny_model("llama", "eager")
    ids = torch.cat([prompt(70, seed=1), prompt(70, seed=2)])
    restkv.configure(model, **small(method, max_capacity_prompt=24, window_size=6))
    _, logits = generate(model, ids, n=5)
    kept = restkv.kept_positions(model)
    sizes = torch.stack([(k >= 0).sum(-1) for k in kept])  # [layers, b, Hkv]
    assert int(sizes.sum()) == 2 * 3 * 2 * 24  # the global budget, every entry of it used
    assert sizes.min() < sizes.max(), "layers (and heads) keep different counts"
    ref = masked_reference_logits(model, ids, kept, 5)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["finch", "entropy_gated_chunkkv", "kvcompose", "kvgrad"])
def test_low_precision_inputs_give_finite_float32_scores(dtype, method):
    obs, *_ = case(n=40, dtype=dtype, budget=16)
    obs.queries, obs.keys = obs.queries * 30, obs.keys * 30  # near one-hot attention
    got = scores_of(obs, method=method)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()


@pytest.mark.parametrize(
    "family, backend", [("llama", "sdpa"), ("llama", "eager"), ("gemma3", "sdpa")]
)
def test_kvcompose_pass_in_forwards_of_7_tokens_equals_one_forward(family, backend, monkeypatch):
    """The second reading fed in forwards of 7 tokens (the views keeping its own entries between
    them) gives one forward's scores, kept entries and tokens, on a left-padded batch."""
    from helpers import generate, prompt, small, tiny_model

    import restkv
    from restkv.eviction import deferred

    replayed = []
    real = deferred.replay_scores

    def replay(*args):
        replayed.append(real(*args))
        return replayed[-1]

    monkeypatch.setattr(deferred, "replay_scores", replay)
    model = tiny_model(family, backend)
    ids = torch.cat([prompt(50, seed=3), prompt(50, seed=4)])
    mask = torch.ones_like(ids)
    ids[1, :9] = 0
    mask[1, :9] = 0
    runs = []
    for chunk in (None, 7):
        monkeypatch.setattr(kvcompose, "PASS_CHUNK", chunk)
        restkv.configure(model, **small("kvcompose", max_capacity_prompt=20, window_size=4))
        tokens, _ = generate(model, ids, mask, n=4)
        runs.append((replayed[-1], tokens, restkv.kept_positions(model)))
    (one, tokens, kept), (chunked, chunked_tokens, chunked_kept) = runs
    assert one.keys() == chunked.keys() and len(one) > 0
    for layer in one:
        assert one[layer].shape == (2, 2, 50)
        torch.testing.assert_close(chunked[layer], one[layer], rtol=1e-5, atol=1e-6)
    assert torch.equal(chunked_tokens, tokens)
    for a, b in zip(chunked_kept, kept):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
