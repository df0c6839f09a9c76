"""Eviction composed with KV quantization (transformers' quantized cache layers)."""

from __future__ import annotations

import pytest
import torch

import restkv
from restkv.cache import held_bytes
from helpers import cache_of, prompt, tiny_model

pytest.importorskip("hqq", reason="the quant extra (hqq) is not installed")


def _run(model, ids, **knobs):
    restkv.configure(model, **knobs)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), cache_of(out)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_8bit_quantized_evicted_cache_agrees_with_evicted(backend):
    model = tiny_model("llama", backend, head_dim=64, hidden_size=96, num_attention_heads=6)
    ids = prompt(120)
    knobs = dict(method="restkv", max_capacity_prompt=48, window_size=8)
    ref_tokens, ref_logits, ref_cache = _run(model, ids, **knobs)
    tokens, logits, cache = _run(model, ids, quant_method="hqq", nbits=8, residual_length=4, **knobs)
    assert torch.equal(tokens[:, :3], ref_tokens[:, :3])
    torch.testing.assert_close(logits, ref_logits, rtol=0.05, atol=0.05)
    assert (logits - ref_logits).abs().max() > 0, "the quantized path really ran"
    for q_layer, layer in zip(cache.layers, ref_cache.layers):
        assert held_bytes(q_layer) < 0.5 * held_bytes(layer)


def test_bytes_fall_with_bits():
    model = tiny_model("llama", "sdpa", head_dim=64, hidden_size=96, num_attention_heads=6)
    ids = prompt(200)
    sizes = {}
    for nbits in (8, 4, 2):
        _, _, cache = _run(model, ids, method="snapkv", max_capacity_prompt=128, window_size=8,
                           quant_method="hqq", nbits=nbits, residual_length=64)
        sizes[nbits] = held_bytes(cache.layers[0])
    _, _, cache = _run(model, ids, method="snapkv", max_capacity_prompt=128, window_size=8)
    full_precision = held_bytes(cache.layers[0])
    assert full_precision > sizes[8] > sizes[4] > sizes[2]
    report = restkv.memory_report(cache)
    assert [r["tokens"] for r in report] == [205] * 3  # 200 prompt + 5 decoded (the last token is not fed)
    assert report[0]["full_bytes"] == 205 * 2 * 64 * 2 * 4 and report[0]["held_bytes"] == full_precision


def test_fullkv_can_be_quantized_too():
    model = tiny_model("qwen2", "sdpa", head_dim=64, hidden_size=96, num_attention_heads=6)
    ids = prompt(100)
    ref_tokens, _, ref_cache = _run(model, ids, method="fullkv")
    tokens, _, cache = _run(model, ids, method="fullkv", quant_method="hqq", nbits=8, residual_length=4)
    assert torch.equal(tokens[:, :3], ref_tokens[:, :3])
    assert held_bytes(cache.layers[0]) < held_bytes(ref_cache.layers[0])
    assert restkv.kept_positions(model)[0].shape == (1, 2, 100)


def test_missing_backend_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("optimum") else real(name, *a))
    with pytest.raises(ValueError, match="pip install optimum-quanto"):
        restkv.CompressionConfig(quant_method="quanto", nbits=4)


def test_bad_quant_knobs():
    with pytest.raises(ValueError, match="nbits"):
        restkv.CompressionConfig(quant_method="hqq", nbits=5)
    with pytest.raises(ValueError, match="quant_method"):
        restkv.CompressionConfig(quant_method="gptq")
