"""Eviction during decoding (``decode_interval``): the bound, the prefill-only limit, exactness against the
full cache with masks that change as decoding evicts, sweep mode, and the knob's checks."""

from __future__ import annotations

import json

import pytest
import torch

import restkv
from restkv.cache import VarlenLayer
from restkv.config import CompressionConfig, declared
from restkv.eviction.plans import is_deferred
from restkv.methods import REGISTRY
from helpers import CACHE, cache_of, generate, masked_reference_logits, prompt, small, tiny_model

B, W = 24, 6
CASES = [  # (method knobs, per-head budgets)
    (dict(method="snapkv"), False),
    (dict(method="restkv"), False),
    (dict(method="h2o"), False),
    (dict(method="tova"), False),
    (dict(method="streamingllm"), False),
    (dict(method="random"), False),
    (small("lacache"), False),
    (dict(method="restkv", gqa_agg="none"), False),
    (dict(method="adakv"), True),
    (dict(method="adakv", varlen=False), True),
    (dict(method="restkv", head_budget="adakv", gqa_agg="none", floor=0.0), True),
]


def held_per_head(layer) -> torch.Tensor:
    """[b, H] entries each head of an evicting layer holds."""
    return layer.stored_entries()[2].sum(-1)


def decode(model, ids, n, record=False):
    """Greedy decoding step by step on the configured model: logits [b, n, V] and, per step, the positions
    every layer holds (``record``), checked against nothing here."""
    out = model(ids, use_cache=True)
    cache, logits, held = cache_of(out), [out.logits[:, -1]], []
    for _ in range(n - 1):
        held.append([layer.stored_entries()[3] for layer in cache.layers] if record else cache)
        out = model(logits[-1].argmax(-1, keepdim=True), use_cache=True, **{CACHE(model): cache})
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1), held, cache


@pytest.mark.parametrize("knobs,per_head", CASES)
def test_decoding_equals_full_cache_with_masks_that_change(knobs, per_head):
    model = tiny_model("llama", "eager", seed=3)
    ids = torch.cat([prompt(50, seed=1), prompt(50, seed=2)])
    restkv.configure(model, max_capacity_prompt=B, window_size=W, decode_interval=4, **knobs)
    logits, held, cache = decode(model, ids, 14, record=True)
    assert all(getattr(layer, "policy", None) for layer in cache.layers)
    assert any(not torch.equal(a[0].sort(-1).values[..., :B], b[0].sort(-1).values[..., :B])
               for a, b in zip(held, held[1:])), "the held prompt entries change while decoding"
    lengths = torch.stack([(p >= 0).sum(-1) for p in held[-1]])
    assert (lengths.min() < lengths.max()) == per_head
    ref = masked_reference_logits(model, ids, held, 14)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


MERGING = [(dict(method="cam"), False), (dict(method="snapkv", merge="pivot"), False)]  # values change: not masking


@pytest.mark.parametrize("method", [m for m in restkv.METHODS if REGISTRY[m].evicts])
def test_every_method_evicts_while_decoding(method, tmp_path):
    knobs = small(method, max_capacity_prompt=B, window_size=W, decode_interval=3)
    if is_deferred(CompressionConfig(**small(method, max_capacity_prompt=B, window_size=W))) or REGISTRY[
            method].reads_hidden:  # its selection waits for every layer, or it reads the prompt's hidden states
        with pytest.raises(ValueError, match="decode_interval"):
            CompressionConfig(**knobs)
        return
    if declared(method)["head_budget"].default == "headkv":
        table = torch.rand(3, 6, generator=torch.Generator().manual_seed(0))
        (tmp_path / "heads.json").write_text(json.dumps(table.tolist()))
        knobs["head_importance"] = str(tmp_path / "heads.json")
    model = tiny_model("llama", "eager", seed=1)
    ids = torch.cat([prompt(50, seed=3), prompt(50, seed=4)])
    restkv.configure(model, **knobs)
    logits, held, cache = decode(model, ids, 9, record=True)
    held_now = torch.stack([torch.stack([(p >= 0).sum(-1) for p in step]) for step in held])  # [steps, layers, b, H]
    plans = [layer.policy for layer in cache.layers]  # a layer's total: PyramidKV's per layer, HeadKV's table
    total = torch.tensor([2 * p.budgets[0] if p.plan.table is None else int(p.plan.table.sum()) + 2 * W for p in plans])
    assert (held_now.sum(-1) <= total[:, None] + 2 * (3 - 1)).all()  # + the steps since the last eviction
    if CompressionConfig(**knobs).get("merge", "none") == "none":  # merging changes values: not a masking
        torch.testing.assert_close(logits, masked_reference_logits(model, ids, held, 9), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("knobs,per_head", CASES[:2] + CASES[-4:] + MERGING)
def test_the_cache_stays_bounded_at_every_step(knobs, per_head):
    model = tiny_model("qwen2", "sdpa")
    ids = prompt(70)
    interval = 5
    restkv.configure(model, max_capacity_prompt=B, window_size=W, decode_interval=interval, **knobs)
    out = model(ids, use_cache=True)
    cache, tok, sizes = cache_of(out), out.logits[:, -1:].argmax(-1), []

    def before_attention(module, args, kwargs):  # what the layer holds once this step's entry is appended
        layer = kwargs[CACHE(module)].layers[module.layer_idx]
        sizes.append(held_per_head(layer) + 1)

    hooks = [m.self_attn.register_forward_pre_hook(before_attention, with_kwargs=True) for m in model.model.layers]
    try:
        for _ in range(3 * interval + 2):
            out = model(tok, use_cache=True, **{CACHE(model): cache})
            tok = out.logits[:, -1:].argmax(-1)
    finally:
        for h in hooks:
            h.remove()
    sizes = torch.stack(sizes)  # [steps x layers, b, H]
    heads = sizes.shape[-1]
    if per_head:  # heads share the layer's budget: the layer holds at most heads x (budget + interval)
        assert int(sizes.sum(-1).max()) <= heads * (B + interval)
        assert int(sizes.max()) > B + interval  # one head holds more than a uniform share
    else:
        assert int(sizes.max()) == B + interval
    assert cache.layers[0].get_seq_length() == 70 + 3 * interval + 2  # positions continue over evictions


@pytest.mark.parametrize("knobs", [dict(method="snapkv"), dict(method="adakv"), dict(method="restkv", gqa_agg="none")])
def test_an_interval_longer_than_the_generation_is_prefill_only_eviction(knobs):
    model = tiny_model("llama", "sdpa")
    ids = torch.cat([prompt(60, seed=1), prompt(60, seed=2)])
    results = []
    for interval in (0, 9):
        restkv.configure(model, max_capacity_prompt=B, window_size=W, decode_interval=interval, **knobs)
        results.append(generate(model, ids, n=9))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_a_short_prompt_is_bounded_once_decoding_outgrows_the_budget():
    model = tiny_model("llama", "sdpa")
    restkv.configure(model, method="snapkv", max_capacity_prompt=B, window_size=W, decode_interval=4)
    out = model.generate(prompt(10), max_new_tokens=30, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    assert all(layer.keys.shape[-2] < B + 4 for layer in cache_of(out).layers)
    assert cache_of(out).get_seq_length() == 10 + 29


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sweep_equals_configure_and_generate(family):
    model = tiny_model(family, "sdpa")
    ids = torch.cat([prompt(70, seed=1), prompt(70, seed=2)])
    configs = [dict(method="snapkv", max_capacity_prompt=B, window_size=W, decode_interval=4),
               dict(method="adakv", max_capacity_prompt=B, window_size=W, decode_interval=3),
               dict(method="restkv", max_capacity_prompt=B, window_size=W, decode_interval=5, gqa_agg="none"),
               dict(method="snapkv", max_capacity_prompt=B, window_size=W)]
    swept = restkv.sweep(model, ids, None, configs, 12, eos_token_id=None)
    for cfg, (tokens, kept) in zip(configs, swept):
        restkv.configure(model, **cfg)
        ref, _ = generate(model, ids, n=12)
        assert torch.equal(tokens, ref), cfg
        assert all(torch.equal(a, b) for a, b in zip(kept, restkv.kept_positions(model)) if a is not None)


def test_varlen_decode_eviction_keeps_the_packed_layout():
    model = tiny_model("llama", "sdpa")
    restkv.configure(model, method="adakv", max_capacity_prompt=B, window_size=W, decode_interval=3, floor=0.0)
    _, _, cache = decode(model, torch.cat([prompt(60, seed=1), prompt(60, seed=2)]), 8)
    for layer in cache.layers:
        assert isinstance(layer, VarlenLayer)
        assert int(layer.lengths.sum()) <= 2 * 2 * (B + 3)


def test_bad_decode_interval_raises():
    with pytest.raises(ValueError, match="decode_interval must be >= 0"):
        restkv.CompressionConfig(method="snapkv", decode_interval=-1)
    with pytest.raises(ValueError, match="decode_interval is not a knob of method fullkv"):
        restkv.CompressionConfig(method="fullkv", decode_interval=4)
    with pytest.raises(ValueError, match="decode_interval needs full-precision"):
        restkv.CompressionConfig(method="snapkv", decode_interval=8, quant_method="hqq", nbits=4)
    assert restkv.CompressionConfig(method="snapkv").decode_interval == 0
