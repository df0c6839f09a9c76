"""Memory linear in the prompt: the blocked float32 work (H2O, pivot merging, refinement, ReST-KV's
query_window, the scores of a repeat pass's queries) equals the unblocked computation with a small block forced, and KVzip's passes and sweep mode
hold no second full copy of the cache."""

from __future__ import annotations

import pytest
import torch
from helpers import PeakBytes

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
            logits = (q[b, :, t][:, None] @ k[b].transpose(-1, -2))[:, 0] * obs.scaling
            ref[b] += logits.masked_fill(~seen, float("-inf")).softmax(-1)
    torch.testing.assert_close(got.double(), ref[..., : obs.prefix_len], rtol=1e-4, atol=1e-5)


def test_pivot_merge_blocked_equals_one_block(monkeypatch):
    from restkv.scoring import output_error as oe

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 50, 8, generator=g), torch.randn(2, 3, 50, 8, generator=g)
    idx = torch.randperm(50, generator=g)[:12].sort().values.expand(2, 3, 12).contiguous()
    evicted = torch.ones(2, 3, 50, dtype=torch.bool).scatter_(2, idx, False)
    monkeypatch.setattr(oe, "TERMS_BLOCK", 1 << 40)  # one block
    whole = merge.pivot_merge(k.double(), v.double(), idx, evicted)
    monkeypatch.setattr(oe, "TERMS_BLOCK", 2 * 3 * 12 * 7)  # similarities of 7 entries a block
    blocked = merge.pivot_merge(k.double(), v.double(), idx, evicted)
    for a, b in zip(blocked, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def pivot_merge_loop(keys, values, kept, evicted):
    """The definition in float64, entry by entry: each evicted entry goes to the kept entry of most
    cosine-similar key; ``new_r = (r + sum_e (x_e + r) / 2) / (1 + n_r)`` for keys and values."""
    k, v = keys.double(), values.double()
    out_k, out_v = k[kept].clone(), v[kept].clone()
    count = torch.zeros(len(kept), dtype=torch.float64)
    for e in evicted.nonzero()[:, 0].tolist():
        r = int(torch.nn.functional.cosine_similarity(k[e][None], k[kept], eps=1e-6).argmax())
        out_k[r] += (k[e] + k[kept[r]]) / 2
        out_v[r] += (v[e] + v[kept[r]]) / 2
        count[r] += 1
    return out_k / (1 + count[:, None]), out_v / (1 + count[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pivot_merge_in_blocks_equals_a_float64_loop(dtype):
    """Random kept sets per head, padding never merged; the layer's K+V is large enough for several
    blocks of 1/16 of it, and no [b, Hkv, L, B] float32 similarity is ever held whole."""
    b, h, n, d, kept_count = 2, 2, 2048, 16, 96
    g = torch.Generator().manual_seed(7)
    k = torch.randn(b, h, n, d, generator=g).to(dtype)
    v = torch.randn(b, h, n, d, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(n, generator=g)[:kept_count].sort().values
                       for _ in range(b * h)]).view(b, h, kept_count)
    real = torch.ones(b, n, dtype=torch.bool)
    real[1, :300] = False  # a left-padded sample
    evicted = torch.ones(b, h, n, dtype=torch.bool).scatter_(2, idx, False) & real[:, None]
    with PeakBytes() as mem:
        mk, mv = merge.pivot_merge(k, v, idx, evicted)
    assert mem.peak < b * h * n * kept_count * 4 / 4  # a quarter of the whole float32 similarity
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for i in range(b):
        for j in range(h):
            ref_k, ref_v = pivot_merge_loop(k[i, j], v[i, j], idx[i, j], evicted[i, j])
            torch.testing.assert_close(mk[i, j].double(), ref_k.to(dtype).double(), **tol)
            torch.testing.assert_close(mv[i, j].double(), ref_v.to(dtype).double(), **tol)


def _refine_case(seed=0, b=2, hkv=2, g=2, r=5, n=40, d=8):
    from restkv.strategies.refine import top_set

    gen = torch.Generator().manual_seed(seed)
    attention = torch.randn(b, hkv * g, r, n, generator=gen).softmax(-1)
    values = torch.randn(b, hkv, n, d, generator=gen)
    w_o = torch.randn(3 * d, hkv * g * d, generator=gen) / d
    prefix = n - 4
    scores = torch.randn(b, hkv, prefix, generator=gen)
    return attention, values, w_o, top_set(scores, 12), scores


def test_refinement_terms_blocked_equal_the_whole(monkeypatch):
    from restkv.scoring import output_error as oe

    attention, values, w_o, keep, _ = _refine_case()
    P = keep.shape[-1]
    layer = oe.layer_terms(values, w_o, P)
    state = oe.output_change(attention, values, keep, w_o)
    terms = oe.state_terms(attention, layer, *state)
    whole = oe.single_errors(terms, layer, state[0], keep)
    removals = keep.float().topk(6, -1).indices
    additions = (~keep).float().topk(5, -1).indices
    swaps = oe.swap_errors(terms, layer, state[0], removals, additions)
    monkeypatch.setattr(oe, "TERMS_BLOCK", 1)  # one entry per block
    small = oe.layer_terms(values, w_o, P)
    torch.testing.assert_close(small[3], layer[3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        oe.single_errors_blocked(attention, small, state, keep), whole, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        oe.swap_errors_at(attention, small, state, removals, additions), swaps, rtol=1e-5, atol=1e-6
    )


def test_swap_search_blocked_equals_one_block(monkeypatch):
    from restkv.scoring import output_error as oe
    from restkv.strategies.refine import swap_search

    attention, values, w_o, keep, scores = _refine_case(seed=4)
    whole = swap_search(attention, values, keep, scores, w_o, rounds=6, pool=8, batch=4, stop=False)
    monkeypatch.setattr(oe, "TERMS_BLOCK", 3 * 2 * 2 * 5)
    blocked = swap_search(
        attention, values, keep, scores, w_o, rounds=6, pool=8, batch=4, stop=False
    )
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[2], whole[2])
    assert int(whole[2].sum()) > 0  # the search swapped something
    torch.testing.assert_close(blocked[1], whole[1])


def test_kvzip_passes_store_nothing_in_the_cache(monkeypatch):
    import restkv
    from helpers import generate, prompt, small, tiny_model
    from restkv.eviction import deferred

    model, ids = tiny_model(), prompt(90)
    views = []
    made = deferred._pass_layer

    def recorded(layer, **kw):
        views.append((layer, made(layer, **kw)))
        return views[-1][1]

    monkeypatch.setattr(deferred, "_pass_layer", recorded)
    with restkv.compressing(model, **small("kvzip", max_capacity_prompt=40)):
        tokens, _ = generate(model, ids, n=3)
    assert views and len(views) % model.config.num_hidden_layers == 0  # every layer of every pass
    for base, view in views:
        assert (
            view.keys is base.keys and view.values is base.values
        )  # nothing stored: no second copy
        assert view.keys.shape[2] == 90
        assert view.pass_entries is None  # KVzip's passes are one forward each: none kept
    monkeypatch.setattr(deferred, "_pass_layer", made)


def _held_during_prefill(model, ids, configs):
    """Per layer, when its attention returns during ``prefill_caches``: the entries each layer holds then."""
    from restkv.eviction.plans import attention_modules
    from restkv.integration.sweeps import prefill_caches

    seen = []

    def hook(module, args, output):
        cache = module._restkv.cache
        seen.append([layer.keys.shape[2] for layer in cache.layers[: module.layer_idx + 1]])

    hooks = [m.register_forward_hook(hook) for m in attention_modules(model)]
    try:
        pre = prefill_caches(model, ids, None, configs)
    finally:
        for h in hooks:
            h.remove()
    return seen, pre


def test_sweep_releases_each_full_layer_once_every_config_has_its_own():
    from helpers import prompt, sweep_equals_separate_runs, tiny_model

    model, ids = tiny_model(), prompt(70)
    configs = [
        dict(method="snapkv", max_capacity_prompt=40),
        dict(method="restkv", max_capacity_prompt=48),
    ]
    seen, _ = _held_during_prefill(model, ids, configs)
    assert seen == [[0], [0, 0], [0, 0, 0]]
    seen, _ = _held_during_prefill(
        model, ids, configs + [dict(method="fullkv")]
    )  # a config reads the full cache
    assert seen == [[70], [70, 70], [70, 70, 70]]
    sweep_equals_separate_runs(model, ids, configs, 4)


QUERY_WINDOW_CASES = [
    dict(metric_mode="after"),
    dict(metric_mode="after", temporal="ema"),
    dict(metric_mode="before", temporal="max", use_norm=True),
    dict(metric_mode="before", temporal="inv-ema", pooling="avgpool"),
    dict(indicator="attn", temporal="last"),
    dict(indicator="attn-v", pooling="none"),
]


@pytest.mark.parametrize("knobs", QUERY_WINDOW_CASES)
def test_query_window_blocked_equals_one_block(knobs, monkeypatch):
    from restkv.methods import restkv as rk
    from restkv.scoring import observe
    from restkv.scoring.observe import wo_factor

    cfg = CompressionConfig(
        method="restkv", max_capacity_prompt=16, window_size=6, query_window=23, **knobs
    ).score_knobs()
    R = wo_factor(torch.randn(32, 32, generator=torch.Generator().manual_seed(1)), 4)

    def scores():
        obs = _obs(b=2, n=50, window=6)
        obs.wo_factor = R
        return rk.score(obs, cfg)

    monkeypatch.setattr(
        observe, "QUERY_BLOCK", 64
    )  # one block of all 23 rows: the unblocked computation
    whole = scores()
    monkeypatch.setattr(observe, "QUERY_BLOCK", 4)
    blocked = scores()
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["kvzip", "restkv_repeat"])
def test_repeat_pass_scored_in_blocks_equals_one_block(method, monkeypatch):
    """A repeat pass's observation (its r queries after the prompt's keys, window r): with a window over
    ``LONG_WINDOW`` its attention is formed a block of rows at a time, with the scores of one block."""
    from restkv.methods import kvzip, restkv_repeat
    from restkv.scoring import observe
    from restkv.scoring.observe import wo_factor

    module = kvzip if method == "kvzip" else restkv_repeat
    cfg = CompressionConfig.from_kwargs(
        method=method, max_capacity_prompt=16, window_size=4, tokenizer="unused"
    ).score_knobs()
    R = wo_factor(torch.randn(32, 32, generator=torch.Generator().manual_seed(1)), 4)
    g = torch.Generator().manual_seed(2)
    r, n = 23, 50
    q = torch.randn(1, 4, r, 8, generator=g)
    k = torch.randn(1, 2, n, 8, generator=g)
    v = torch.randn(1, 2, n, 8, generator=g)

    def scores():
        obs = Observation(q, k, v, torch.ones(1, n, dtype=torch.bool), window=r, budget=n,
                          scaling=8**-0.5, wo_factor=R)
        return module.score(obs, cfg)

    whole = scores()  # 23 rows <= LONG_WINDOW: the shared window attention
    rows = []
    attention = Observation.attention
    monkeypatch.setattr(Observation, "attention",
                        lambda self, start, stop: rows.append(stop - start) or attention(self, start, stop))
    monkeypatch.setattr(observe, "LONG_WINDOW", 4)
    monkeypatch.setattr(observe, "QUERY_BLOCK", 4)
    blocked = scores()
    assert rows == [4] * 5 + [3]
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)
