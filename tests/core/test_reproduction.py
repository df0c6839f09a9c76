"""ReST-KV as the authors' released code defines it, against references written from those definitions.

The drift of the adaptive window, the ablation grid (indicator x temporal smoothing), and the pieces
the paper's tables need.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from restkv.config import CompressionConfig
from restkv.methods import restkv as rk
from restkv.scoring.observe import Observation, wo_factor
from restkv.eviction.select import select


def _obs(b=1, hq=4, hkv=2, n=40, d=8, window=6, budget=16, seed=0, layer=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv))
    return Observation(q, k, v, torch.ones(b, n, dtype=torch.bool), window=window, budget=budget, scaling=d**-0.5,
                       wo_factor=wo_factor(torch.randn(24, hq * d, generator=g), hq), layer=layer)


def _score(obs, **knobs):
    cfg = CompressionConfig(max_capacity_prompt=obs.budget, window_size=obs.window, **knobs)
    return rk.score(obs, cfg.score_knobs())


def _drift_reference(rows, top):
    """The original: each row's own top-``top`` positions; older half's mean minus newer half's mean."""
    def mean_top(row):
        order = sorted(range(len(row)), key=lambda j: -row[j])[:top]
        return sum(order) / top

    w = len(rows)
    return (sum(mean_top(r) for r in rows[: w // 2]) / (w // 2)
            - sum(mean_top(r) for r in rows[w // 2:]) / (w - w // 2))


def test_drift_takes_each_rows_own_top_positions():
    A = torch.full((1, 1, 4, 100), 1e-4)
    A[0, 0, 0, 90], A[0, 0, 0, 5], A[0, 0, 0, 6] = 0.9, 0.05, 0.049  # row 0: one far key, two early ones
    A[0, 0, 1, 20], A[0, 0, 1, 21] = 0.45, 0.449  # row 1: two early keys
    A[0, 0, 2:, 40], A[0, 0, 2:, 41] = 0.45, 0.449  # the newer half looks at 40-41
    got = float(rk.window_drift(A, 2))
    assert got == pytest.approx(_drift_reference(A[0, 0].tolist(), 2)) == pytest.approx(-6.5)
    summed_first = A[0, 0, :2].sum(0).topk(2).indices.float().mean()  # the half's summed rows: the other sign
    assert float(summed_first - 40.5) > 0


def test_drift_is_per_sample():
    A = torch.rand(2, 3, 8, 60)
    got = rk.window_drift(A, 5)
    for b in range(2):
        for h in range(3):
            assert float(got[b, h]) == pytest.approx(_drift_reference(A[b, h].tolist(), 5), abs=1e-4)


def _aggregate(rows, temporal, alpha=0.3):
    """Float64 loops: last row, mean, EMA oldest -> newest, EMA newest -> oldest."""
    if temporal == "last":
        return rows[-1]
    if temporal == "mean":
        return sum(rows) / len(rows)
    seq = rows if temporal == "ema" else rows[::-1]
    acc = seq[0]
    for r in seq[1:]:
        acc = alpha * r + (1 - alpha) * acc
    return acc


@pytest.mark.parametrize("temporal", ["last", "mean", "ema", "inv-ema"])
@pytest.mark.parametrize("indicator", ["attn", "attn-v", "reconstruction"])
def test_ablation_indicators_and_temporal_modes_against_loops(indicator, temporal):
    obs = _obs()
    got = _score(obs, indicator=indicator, temporal=temporal, pooling="none")
    A, P = obs.window_attention.double(), obs.prefix_len
    R = obs.wo.double()
    ref = torch.zeros(1, 4, P, dtype=torch.float64)
    for h in range(4):
        v = obs.values[0, h // 2, :P].double()
        a = _aggregate([A[0, h, i, :P] for i in range(obs.window)], temporal)
        if indicator == "attn":
            ref[0, h] = a
        elif indicator == "attn-v":
            ref[0, h] = a * v.norm(dim=-1)
        else:
            o = a @ v
            for j in range(P):
                ref[0, h, j] = a[j] / (1 - a[j]) * (R[h] @ (o - v[j])).norm()
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-7)


def test_random_indicator_is_seeded_and_differs_per_layer():
    first = _score(_obs(layer=0), indicator="random", random_seed=3)
    assert torch.equal(first, _score(_obs(layer=0, seed=9), indicator="random", random_seed=3))  # inputs do not matter
    assert not torch.equal(first, _score(_obs(layer=1), indicator="random", random_seed=3))
    assert not torch.equal(first, _score(_obs(layer=0), indicator="random", random_seed=4))
    assert first.shape == (1, 2, 34) and 0 <= float(first.min()) and float(first.max()) < 1


def test_attention_indicator_with_mean_and_avgpool_is_snapkv():
    obs = _obs(n=64, budget=24)
    rows = dict(max_capacity_prompt=24, window_size=6, kernel_size=5)
    ablation = select(obs, CompressionConfig(indicator="attn", temporal="mean", pooling="avgpool", **rows))
    snap = select(obs, CompressionConfig(method="snapkv", **rows))
    assert torch.equal(ablation.positions, snap.positions)


def test_adaptive_pooling_reproduces_the_original_kernel_and_shift():
    """kernel max(k, 2 floor(|t|/s) + 1), shift floor(t/s) (+1 when t <= 0), replicate padding, as the original."""
    scores = torch.rand(1, 3, 50)
    drift = torch.tensor([[0.0, 450.0, -450.0]])
    got = rk.adaptive_pool(scores, drift, kernel_size=5, scale=200.0)
    for h, (k, s) in enumerate([(5, 1), (5, 2), (5, -2)]):
        x = F.pad(scores[0, h][None, None], (k // 2 - s, k // 2 + s), mode="replicate")
        torch.testing.assert_close(got[0, h], F.avg_pool1d(x, k, stride=1)[0, 0])


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("knobs", [dict(method="restkv", preset="paper"), dict(method="snapkv"),
                                   dict(method="adakv"), dict(method="h2o")])
def test_one_set_per_query_head_decodes_as_the_masked_full_cache(backend, knobs):
    """gqa_agg="none": each query head keeps its own entries (the original's caches), decoding exact on them."""
    import restkv
    from helpers import cache_of, generate, masked_reference_logits, prompt, tiny_model

    model = tiny_model("llama", backend)  # 6 query heads, 2 KV heads
    ids = prompt(70)
    restkv.configure(model, max_capacity_prompt=20, window_size=4, gqa_agg="none", **knobs)
    layer = cache_of(model(ids, use_cache=True)).layers[0]
    assert layer.keys.shape[0] == 6 * 20  # 6 query heads x 20 entries, packed (AdaKV: 20 on average)
    tokens, logits = generate(model, ids, n=5)
    kept = restkv.kept_positions(model)
    assert all(k.shape[:2] == (1, 6) for k in kept)
    groups = [k.view(2, 3, -1).sort(-1).values for k in kept]  # per layer [KV head, query head, K]
    assert any((g != g[:, :1]).any() for g in groups) or knobs["method"] == "h2o"  # query heads of a group differ
    ref = masked_reference_logits(model, ids, kept, 5)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_one_set_per_query_head_refuses_what_it_cannot_hold():
    for knobs in (dict(merge="pivot"), dict(head_budget="headkv", head_importance="x.json"), dict(quant_method="hqq")):
        with pytest.raises(ValueError, match="gqa_agg"):
            CompressionConfig(gqa_agg="none", **knobs)


def test_budget_as_a_fraction_of_each_sample():
    """max_capacity_prompt_ratio: round(L * ratio) per sample (window included), as the original's runner."""
    import restkv
    from helpers import generate, prompt, tiny_model

    model = tiny_model("llama", "sdpa")
    long, short = prompt(80, seed=1), prompt(50, seed=2)
    restkv.configure(model, method="snapkv", max_capacity_prompt_ratio=0.3, window_size=4)
    generate(model, long, n=2)
    assert [k.shape[-1] for k in restkv.kept_positions(model)] == [round(80 * 0.3)] * 3
    ids = torch.cat([torch.zeros(1, 30, dtype=torch.long), short], 1)
    batch, mask = torch.cat([long, ids]), torch.cat([torch.ones(1, 80), torch.cat([torch.zeros(1, 30), torch.ones(1, 50)], 1)]).long()
    tokens, logits = generate(model, batch, mask, n=4)
    kept = restkv.kept_positions(model)
    for layer in kept:
        real = (layer >= 0).sum(-1)
        assert (real[0] == 24).all() and (real[1] == round(50 * 0.3)).all()  # 24 and 15 entries
    alone, alone_logits = generate(model, short, n=4)
    assert torch.equal(tokens[1], alone[0])
    torch.testing.assert_close(logits[1], alone_logits[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="max_capacity_prompt is read .* only when max_capacity_prompt_ratio is None"):
        CompressionConfig(max_capacity_prompt=64, max_capacity_prompt_ratio=0.5)


def test_tova_keeps_what_the_last_query_attends_to_averaged_over_heads():
    obs = _obs(hq=4, hkv=2, n=30, window=3, budget=8)
    A = obs.window_attention
    kept = select(obs, CompressionConfig(method="tova", max_capacity_prompt=8, window_size=3))
    mean_last = sum(A[0, h, -1, :27] for h in range(4)) / 4  # the paper: one row, the heads' mean
    expect = sorted(sorted(range(27), key=lambda j: -float(mean_last[j]))[:5]) + [27, 28, 29]
    assert kept.positions[0, 0].tolist() == kept.positions[0, 1].tolist() == expect  # every head alike


def test_lacache_ladder_on_a_hand_made_case():
    """4 layers, span 2: groups of 2 tokens, each layer keeps one, successive layers alternate (the ladder)."""
    from test_lacache import ladder

    for layer in range(4):
        kept = ladder(40, cache=24, start=4, layers=4, layer=layer, span=2, overlap=0)
        assert kept == [0, 1, 2, 3] + [4 + layer % 2 + 2 * j for j in range(16)] + list(range(36, 40))
    assert ladder(20, cache=24, start=4, layers=4, layer=0, span=2, overlap=0) == list(range(20))


def test_lacache_compacts_again_when_one_ladder_pass_does_not_fit():
    from test_lacache import ladder

    layers = [ladder(100, cache=24, start=4, layers=4, layer=i, span=2, overlap=0) for i in range(4)]
    for kept in layers:
        assert len(kept) == 24 and kept[:4] == [0, 1, 2, 3] and kept[-5:] == list(range(95, 100))
        gaps = [b - a for a, b in zip(kept[4:-5], kept[5:-4])]
        assert max(gaps) > 2 and gaps == sorted(gaps, reverse=True)  # older entries sparser than newer
    assert len({tuple(k) for k in layers}) > 1  # the layers' ladders differ


def test_lacache_on_a_model_keeps_the_budget_and_checks_the_span():
    import restkv
    from helpers import generate, prompt, tiny_model

    model = tiny_model("llama", "sdpa", num_hidden_layers=4)
    restkv.configure(model, method="lacache", span=2, max_capacity_prompt=24, window_size=4, sink_tokens=4)
    generate(model, prompt(60), n=2)
    kept = restkv.kept_positions(model)
    assert all(k.shape == (1, 2, 24) for k in kept) and not torch.equal(kept[0], kept[1])
    with pytest.raises(ValueError, match="span .* must be smaller than the model's evicted layers"):
        restkv.configure(model, method="lacache", span=16, max_capacity_prompt=24, window_size=4)
