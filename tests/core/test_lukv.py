"""LU-KV's per-head budgets (``head_budget="lukv"``) against a float64/int loop of kvpress ``LUKVPress.compress``'s
allocation: the kept counts per head, the kept sets (each head's top scores with its count, sinks and window
protected), per sample in a padded batch, and the refusals before any forward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import generate, lukv_curve, prompt, tiny_model
from transformers import DynamicCache

import restkv
from restkv.config import CompressionConfig
from restkv.strategies.budgets import lukv_sizes


def kvpress_keep(curve, length: int, budget: int) -> list[int]:
    """kvpress's keep count of each KV head (window and sinks included) for L = ``length`` tokens at
    compression ratio ``1 - budget / length``; ``curve`` [99][Hkv] prune ratios, float64 and ints."""
    ratio = 1.0 - budget / length
    heads = len(curve[0])
    if ratio <= 0:
        return [length] * heads
    row = max(0, min(98, round(ratio * 100) - 1))
    exact = [min(1.0, max(0.0, 1.0 - float(p))) * length for p in curve[row]]
    total = max(heads, min(heads * length, round(sum(exact))))
    keep = [math.floor(x) for x in exact]
    remainder = total - sum(keep)
    by_fraction = sorted(range(heads), key=lambda h: (-(exact[h] - keep[h]), h))  # ties: lower head first
    for h in by_fraction[: max(0, min(remainder, heads))]:
        keep[h] += 1
    return [min(length, max(1, k)) for k in keep]


def hand_curve(heads: int = 4) -> np.ndarray:
    """[99, heads]: each row's mean ratio near the row's, heads spread, some out of [0, 1], ties, halves."""
    rows = np.arange(1, 100)[:, None] / 100
    spread = np.array([-0.3, 0.0, 0.0, 0.25, 0.5, -0.6][:heads])
    curve = rows + spread
    curve[10] = [0.5] * heads  # equal fractional parts: the tie rule
    curve[49] = [1.2, -0.2, 0.5, 0.125][:heads]  # clamped keep rates
    curve[98] = [1.0] * heads  # keeps nothing: each head at least 1 (Hkv in all)
    return curve


@pytest.mark.parametrize("length", [7, 40, 97, 256, 1000])
@pytest.mark.parametrize("window", [0, 1, 4])
def test_sizes_are_kvpress_allocation(length, window):
    curve = hand_curve()
    budgets = sorted({1, 2, max(1, length // 9), length // 2, length - 1, length, length + 5})
    lengths = torch.tensor([length])
    for budget in budgets:
        got = lukv_sizes(torch.from_numpy(curve), lengths, budget, window)[0].tolist()
        want = [max(0, k - window) for k in kvpress_keep(curve, length, budget)]
        assert got == want, (length, budget, window)


def test_sizes_per_sample_of_a_batch():
    curve = hand_curve()
    lengths = torch.tensor([40, 97, 11, 256])
    got = lukv_sizes(torch.from_numpy(curve), lengths, 30, 1)
    want = [[max(0, k - 1) for k in kvpress_keep(curve, n, 30)] for n in lengths.tolist()]
    assert got.tolist() == want
    assert got.dtype == torch.long


def test_every_row_is_reached():
    curve = np.random.default_rng(0).uniform(0, 1, (99, 3))
    for length in (100, 333):
        for budget in range(1, length + 1):
            got = lukv_sizes(torch.from_numpy(curve), torch.tensor([length]), budget, 0)[0].tolist()
            assert got == kvpress_keep(curve, length, budget)


def _keys(model, ids):
    """Each layer's keys after RoPE [b, Hkv, L, d] of a full-cache prefill."""
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    return [layer.keys for layer in cache.layers]


def _reference_kept(keys, curve, budget: int, sink: int, window: int) -> list[set]:
    """kvpress's kept set of each head of one sample: L2Norm's scores, sinks and window on top, the top
    count by a stable sort (keys [Hkv, L, d], curve [99, Hkv])."""
    length = keys.shape[1]
    scores = -keys.double().norm(dim=-1)
    scores[:, :sink] = float("inf")
    scores[:, length - window :] = float("inf")
    counts = kvpress_keep(curve, length, budget)
    order = scores.argsort(dim=-1, descending=True, stable=True)
    return [set(order[h, :k].tolist()) for h, k in enumerate(counts)]


def _kept_sets(kept) -> list[list[set]]:
    """kept positions [b, Hkv, K] -> per sample, per head, the set of kept positions."""
    return [[set(p[p >= 0].tolist()) for p in sample] for sample in kept]


@pytest.mark.parametrize("window", [1, 4])
def test_kept_sets_on_a_tiny_model(tmp_path, window):
    model = tiny_model()
    ids = prompt(48)
    path = lukv_curve(tmp_path / "curve.npy")  # every head keeps more than its sinks and window
    curve = np.load(path)
    keys = _keys(model, ids)
    budget = 20
    with restkv.compressing(model, method="l2norm", head_budget="lukv", lukv_curve=path,
                            max_capacity_prompt=budget, window_size=window):
        generate(model, ids, n=2)
        kept = restkv.kept_positions(model)
    for layer, (k, found) in enumerate(zip(keys, kept)):
        want = _reference_kept(k[0], curve[:, layer], budget, 4, window)
        assert _kept_sets(found)[0] == want, layer
        counts = kvpress_keep(curve[:, layer], 48, budget)
        assert (found[0] >= 0).sum(-1).tolist() == counts
        assert len(set(counts)) > 1  # the heads' budgets differ


@pytest.mark.parametrize("ratio", [None, 0.5])
def test_padded_batch_each_sample_on_its_own_length(tmp_path, ratio):
    model = tiny_model()
    lengths = [48, 33]
    ids = prompt(48, batch=2)
    mask = torch.ones_like(ids)
    mask[1, : 48 - lengths[1]] = 0
    ids = ids.masked_fill(mask == 0, 0)
    path = lukv_curve(tmp_path / "curve.npy")  # every head keeps more than its sinks and window
    curve = np.load(path)
    budget = {"max_capacity_prompt": 16} if ratio is None else {"max_capacity_prompt_ratio": ratio}
    with restkv.compressing(model, method="l2norm", head_budget="lukv", lukv_curve=path, window_size=2,
                            **budget) as cfg:
        tokens, logits = generate(model, ids, mask, n=4)
        kept = restkv.kept_positions(model)
    assert torch.isfinite(logits).all() and tokens.shape == (2, 4)
    for s, n in enumerate(lengths):
        ids_s = ids[s : s + 1, 48 - n :]
        keys = _keys(model, ids_s)
        b = 16 if ratio is None else max(cfg.window_size + 1, round(n * ratio))
        for layer, k in enumerate(keys):
            want = _reference_kept(k[0], curve[:, layer], b, 4, 2)
            assert _kept_sets(kept[layer])[s] == want, (s, layer)


def test_method_lukv_is_kvpress_default_pairing(tmp_path):
    cfg = CompressionConfig.from_kwargs(method="lukv", lukv_curve=lukv_curve(tmp_path / "c.npy"))
    assert (cfg.head_budget, cfg.epsilon, cfg.window_size, cfg.lukv_sink) == ("lukv", 0.02, 1, 4)
    assert cfg.scorer.scorer == "restkv.methods.expected_attention"
    model = tiny_model()
    with restkv.compressing(model, method="lukv", lukv_curve=cfg.lukv_curve, max_capacity_prompt=20):
        _, logits = generate(model, prompt(48), n=3)
    assert torch.isfinite(logits).all()


def _refused(model, **knobs) -> str:
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError) as e:
            restkv.configure(model, method="l2norm", head_budget="lukv", max_capacity_prompt=20, window_size=4,
                             **knobs)
    finally:
        hook.remove()
        restkv.detach(model)
    assert not calls  # before any forward
    return str(e.value)


def test_refusals_name_the_knob(tmp_path):
    model = tiny_model()
    assert "lukv_curve" in _refused(model)
    assert "lukv_curve" in _refused(model, lukv_curve=str(tmp_path / "missing.npy"))
    text = tmp_path / "text.npy"
    text.write_text("not an array")
    assert "lukv_curve" in _refused(model, lukv_curve=str(text))
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((99, 2, 2)))  # the tiny model has 3 layers
    assert "(99, 3, 2)" in _refused(model, lukv_curve=str(wrong))
    nan = tmp_path / "nan.npy"
    np.save(nan, np.full((99, 3, 2), np.nan))
    assert "lukv_curve" in _refused(model, lukv_curve=str(nan))
    with pytest.raises(ValueError, match="gqa_agg='none'"):
        CompressionConfig.from_kwargs(method="snapkv", head_budget="lukv", lukv_curve="x.npy", gqa_agg="none")
