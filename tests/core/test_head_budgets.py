"""Per-head budgets (AdaKV, HeadKV) and the variable-length cache."""

from __future__ import annotations

import json

import pytest
import torch

import restkv
from restkv.strategies.budgets import adakv_budgets, headkv_budgets, load_head_importance
from restkv.cache import VarlenLayer, held_bytes
from restkv.cache.packed import varlen_attention
from helpers import CACHE, cache_of, generate, masked_reference_logits, prompt, tiny_model


def test_varlen_attention_equals_dense_per_segment():
    torch.manual_seed(0)
    lengths = torch.tensor([5, 3, 12, 7, 3, 9])
    g, d = 3, 8
    k, v = torch.randn(int(lengths.sum()), d), torch.randn(int(lengths.sum()), d)
    for q_len in (1, 3):  # the last q_len entries of each segment query it causally
        q = torch.randn(6, g, q_len, d)
        out = varlen_attention(q, k, v, lengths, 0.3)
        start = 0
        for s, n in enumerate(lengths.tolist()):
            for i in range(q_len):
                seen = n - q_len + i + 1
                ref = torch.softmax(q[s, :, i] @ k[start : start + seen].T * 0.3, -1) @ v[start : start + seen]
                torch.testing.assert_close(out[s, :, i], ref)
            start += n


@pytest.mark.parametrize("seed", range(4))
def test_adakv_floor_and_total(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, 4, 300, generator=g) ** (1 + 10 * torch.rand(2, 4, 1, generator=g))
    scores[0, 0] *= 1000  # one head would take everything without the floor
    for floor in (0.0, 0.2, 0.5, 1.0):
        budgets = adakv_budgets(scores, 64, floor, normalize=seed % 2 == 1)
        assert (budgets >= int(64 * floor)).all()
        assert (budgets.sum(-1) == 4 * 64).all()  # the layer total equals the uniform total
    assert int(adakv_budgets(scores, 64, 0.0, False)[0, 0]) > 64  # budgets really move between heads


def test_headkv_budgets_total_and_order():
    importance = torch.tensor([[1.0, 3.0], [0.5, 0.5], [2.0, 0.0]], dtype=torch.float64)
    budgets = headkv_budgets(importance, 100, 1.2)
    assert int(budgets.sum()) == 3 * 2 * 100
    assert (budgets >= 100 - int(100 // 1.2)).all()
    assert budgets[0, 1] > budgets[0, 0] > budgets[1, 0]


def _kept_lengths(model):
    return [(k >= 0).sum(-1) for k in restkv.kept_positions(model)]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("method,knobs", [
    ("adakv", {}),
    ("adakv", {"floor": 0.0, "normalize": True}),
    ("restkv", {"head_budget": "adakv", "floor": 0.1}),
    ("snapkv", {"head_budget": "adakv", "use_pyramid": True}),
])
def test_varlen_decoding_equals_masked_full_cache(batch, method, knobs):
    model = tiny_model("llama", "eager", seed=batch)
    ids = torch.cat([prompt(70, seed=s) for s in range(batch)])
    restkv.configure(model, method=method, max_capacity_prompt=24, window_size=6, **knobs)
    _, logits = generate(model, ids, n=5)
    kept = restkv.kept_positions(model)
    lengths = torch.stack([n.flatten() for n in _kept_lengths(model)])
    assert lengths.min() < lengths.max(), "heads keep different numbers of entries"
    ref = masked_reference_logits(model, ids, kept, 5)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_varlen_bytes_follow_the_sum_of_head_lengths():
    model = tiny_model("qwen2", "sdpa")
    ids = torch.cat([prompt(90, seed=1), prompt(90, seed=2)])
    restkv.configure(model, method="adakv", max_capacity_prompt=32, window_size=8, floor=0.0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    prefilled = cache_of(model(ids, use_cache=True))
    for layer, after, kept in zip(cache_of(out).layers, prefilled.layers, restkv.kept_positions(model)):
        assert isinstance(layer, VarlenLayer)
        per_head = (kept >= 0).sum(-1).flatten()  # after prefill
        assert int(per_head.sum()) == 2 * 2 * 32  # AdaKV keeps the uniform total per layer
        assert held_bytes(after) == int(per_head.sum()) * 16 * 2 * 4  # sum(len_h) x head_dim x (K+V) x fp32
        assert torch.equal(layer.lengths, per_head + 2)  # two decoded tokens were appended per head
        room = per_head.numel() * (layer.capacity - layer.steps)  # rows ready for the next appended entries
        assert held_bytes(layer) == (int(layer.lengths.sum()) + room) * 16 * 2 * 4
        assert room <= per_head.numel() * layer.growth(1)
        assert per_head.max() * per_head.numel() > per_head.sum()  # a padded layout would hold more


def _write_table(path, layers, heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(layers, heads, generator=g)
    path.write_text(json.dumps({f"{l}-{h}": [float(scores[l, h]), 0.5] for l in range(layers) for h in range(heads)}))
    return scores


def test_headkv_end_to_end(tmp_path):
    model = tiny_model("llama", "eager")
    table = tmp_path / "heads.json"
    _write_table(table, 3, 6)
    ids = prompt(80)
    restkv.configure(model, method="headkv", max_capacity_prompt=24, window_size=6, head_importance=str(table))
    _, logits = generate(model, ids, n=4)
    lengths = torch.stack([n.flatten() for n in _kept_lengths(model)])
    assert int(lengths.sum()) == 3 * 2 * 24
    assert lengths.min() < lengths.max()
    torch.testing.assert_close(logits, masked_reference_logits(model, ids, restkv.kept_positions(model), 4), rtol=1e-4, atol=1e-4)


def test_bad_headkv_table_raises(tmp_path):
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ValueError, match="not found"):
        restkv.configure(model, method="headkv", head_importance=str(tmp_path / "missing.json"))
    wrong = tmp_path / "wrong.json"
    _write_table(wrong, 2, 6)  # the model has 3 layers
    with pytest.raises(ValueError, match="heads have no score"):
        restkv.configure(model, method="headkv", head_importance=str(wrong))
    too_big = tmp_path / "big.json"
    _write_table(too_big, 4, 6)
    with pytest.raises(ValueError, match="does not fit"):
        restkv.configure(model, method="headkv", head_importance=str(too_big))
    broken = tmp_path / "broken.json"
    broken.write_text('{"0-0": [1.0],\n "0-1": }')
    with pytest.raises(ValueError, match="broken.json:2"):
        restkv.configure(model, method="headkv", head_importance=str(broken))
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([[1.0] * 5] * 3))
    with pytest.raises(ValueError, match="shape"):
        restkv.configure(model, method="headkv", head_importance=str(grid))
    with pytest.raises(ValueError, match="head_importance"):
        restkv.configure(model, method="headkv")
    assert load_head_importance(str(grid), 3, 5, 5).shape == (3, 5)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_masked_layout_equals_varlen(backend):
    model = tiny_model("llama", backend)
    ids = torch.cat([prompt(80, seed=1), prompt(80, seed=2)])
    results = []
    for varlen in (True, False):
        restkv.configure(model, method="adakv", max_capacity_prompt=24, window_size=6, floor=0.0, varlen=varlen)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        results.append((out.sequences, torch.stack(out.logits, 1), held_bytes(cache_of(out).layers[0])))
    (seq_v, logit_v, bytes_v), (seq_m, logit_m, bytes_m) = results
    assert torch.equal(seq_v, seq_m)
    torch.testing.assert_close(logit_v, logit_m, rtol=1e-4, atol=1e-4)
    assert bytes_v < bytes_m


def test_varlen_teacher_forcing_several_tokens_equals_masked_layout():
    model = tiny_model("llama", "sdpa")
    ids = prompt(90)
    logits = []
    for varlen in (True, False):
        restkv.configure(model, method="adakv", max_capacity_prompt=24, window_size=6, floor=0.0, varlen=varlen)
        out = model(ids[:, :80], use_cache=True)
        logits.append(model(ids[:, 80:], use_cache=True, **{CACHE(model): cache_of(out)}).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_headkv_shares_the_pool_of_the_evicted_layers_only(tmp_path):
    """On a model whose sliding-window layers are not evicted, HeadKV's table moves budget among the
    evicted heads only: their total stays that of a uniform budget, whatever the other layers' importance."""
    model = tiny_model("gemma3", "eager", num_hidden_layers=4,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    cfg = model.config
    table = torch.ones(4, cfg.num_attention_heads)
    table[0] = table[2] = 100.0  # the sliding layers claim nearly all importance
    table[3, 0] = 5.0
    (tmp_path / "heads.json").write_text(json.dumps(table.tolist()))
    budget = 24
    restkv.configure(model, method="headkv", max_capacity_prompt=budget, window_size=6,
                     head_importance=str(tmp_path / "heads.json"))
    with torch.no_grad():
        model(prompt(80))
    kept = [k for k in restkv.kept_positions(model) if k is not None]
    assert len(kept) == 2
    held = [int((k >= 0).sum()) for k in kept]
    assert sum(held) == 2 * cfg.num_key_value_heads * budget
    assert held[1] > held[0]  # layer 3 holds the most important head
