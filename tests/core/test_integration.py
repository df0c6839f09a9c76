"""The eviction path on tiny random models of every family x backend."""

from __future__ import annotations

import pytest
import torch

import restkv
from restkv.strategies.budgets import layer_budgets
from restkv.cache import CompressedLayer
from restkv.config import declared
from restkv.eviction.plans import attention_modules
from helpers import FAMILIES, generate, masked_reference_logits, prompt, small, tiny_model

BACKENDS = ["eager", "sdpa"]
CASES = [(f, b) for f in FAMILIES for b in BACKENDS]
PER_HEAD = [m for m in restkv.METHODS  # per-head budgets: tests/core/test_head_budgets.py, test_deferred.py
            if getattr(declared(m).get("head_budget"), "default", "uniform") != "uniform"
            or getattr(declared(m).get("layer_budget"), "default", "uniform") == "global"]
UNIFORM = [m for m in restkv.METHODS if m not in PER_HEAD]
EVICTING = [m for m in UNIFORM if m != "fullkv"]


def _evicted_layers(model):
    return [i for i, k in enumerate(restkv.kept_positions(model)) if k is not None]


@pytest.mark.parametrize("family,backend", CASES)
def test_budget_above_prompt_is_identical_to_plain_model(family, backend):
    model = tiny_model(family, backend)
    ids = prompt(40)
    ref_tokens, ref_logits = generate(model, ids)
    for method in UNIFORM + ["adakv", "kvzip"]:  # kvzip: a prompt within the budget runs no passes
        knobs = small(method, family, max_capacity_prompt=64, window_size=8)
        if knobs is None:
            continue
        restkv.configure(model, **knobs)
        tokens, logits = generate(model, ids)
        assert torch.equal(tokens, ref_tokens), method
        torch.testing.assert_close(logits, ref_logits)


@pytest.mark.parametrize("family,backend", CASES)
def test_cache_shape_window_and_positions(family, backend):
    model = tiny_model(family, backend)
    ids = prompt(80)
    budget, window = 24, 8
    for method in EVICTING:
        knobs = small(method, family, max_capacity_prompt=budget, window_size=window)
        if knobs is None:
            continue
        cfg = restkv.configure(model, **knobs)
        evicted = [i for i, m in enumerate(attention_modules(model)) if m._restkv.plan.evicts]
        budgets = dict(zip(evicted, layer_budgets(cfg, len(evicted), 80)))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        kept = restkv.kept_positions(model)
        for i, layer in enumerate(cache.layers):
            if kept[i] is None:  # sliding-window layer: untouched
                assert not isinstance(layer, CompressedLayer)
                continue
            assert isinstance(layer, CompressedLayer), (method, i)
            # budget entries per KV head after prefill, plus the decoded ones (last token not yet fed)
            assert layer.keys.shape == (1, 2, budgets[i] + 2, 16), (method, layer.keys.shape)
            assert kept[i].shape == (1, 2, budgets[i])
            assert torch.equal(kept[i][..., -window:], torch.arange(80 - window, 80).expand(1, 2, window))
            assert (kept[i].diff(dim=-1) > 0).all(), "positions are distinct and in order"
            assert layer.get_seq_length() == 82


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method", [m for m in EVICTING if m != "cam"])  # CaM rewrites the kept values
def test_decoding_on_evicted_cache_equals_masked_full_cache(family, method):
    model = tiny_model(family, "eager")
    ids = prompt(70)
    restkv.configure(model, **small(method, max_capacity_prompt=30, window_size=6), use_pyramid=method == "restkv")
    _, logits = generate(model, ids, n=5)
    kept = restkv.kept_positions(model)
    ref = masked_reference_logits(model, ids, kept, 5)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,backend", CASES)
def test_padded_batch_equals_single_runs(family, backend):
    model = tiny_model(family, backend)
    long, short = prompt(90, seed=2)[0], prompt(57, seed=3)[0]
    for method in ["restkv", "snapkv", "streamingllm", "h2o"]:
        for budget in (24, 64):  # 64 > len(short): the short sample keeps padding, which must stay masked
            restkv.configure(model, method=method, max_capacity_prompt=budget, window_size=8)
            singles = []
            for seq in (long, short):
                tokens, _ = generate(model, seq[None])
                singles.append((tokens, [k.clone() if k is not None else None for k in restkv.kept_positions(model)]))
            ids = torch.zeros(2, 90, dtype=torch.long)
            mask = torch.zeros(2, 90, dtype=torch.long)
            ids[0], mask[0] = long, 1
            ids[1, -57:], mask[1, -57:] = short, 1
            tokens, _ = generate(model, ids, mask)
            kept = restkv.kept_positions(model)
            for b, (single_tokens, single_kept) in enumerate(singles):
                assert torch.equal(tokens[b], single_tokens[0]), (method, budget, b)
                for layer, (k, ks) in enumerate(zip(kept, single_kept)):
                    if k is None:
                        continue
                    real = k[b][k[b] >= 0].view(k.shape[1], -1)
                    assert torch.equal(real, ks[0]), (method, budget, b, layer)


def test_gemma3_evicts_only_global_layers():
    model = tiny_model("gemma3", "sdpa")
    restkv.configure(model, method="restkv", max_capacity_prompt=24, window_size=8)
    generate(model, prompt(80), n=2)
    assert _evicted_layers(model) == [1]


def test_new_generate_starts_clean():
    model = tiny_model("llama", "sdpa")
    restkv.configure(model, method="snapkv", max_capacity_prompt=24, window_size=8)
    first, _ = generate(model, prompt(80, seed=5))
    generate(model, prompt(60, seed=6))
    again, _ = generate(model, prompt(80, seed=5))
    assert torch.equal(first, again)


def test_configure_rejects_unsupported_backend():
    model = tiny_model("llama", "sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation"):
        restkv.configure(model, method="snapkv")


def test_unconfigured_model_is_untouched_by_install():
    restkv.replace_llama()
    model = tiny_model("llama", "eager")
    ids = prompt(50)
    ref_tokens, ref_logits = generate(model, ids)
    other = tiny_model("llama", "eager")
    restkv.configure(other, method="snapkv", max_capacity_prompt=16, window_size=4)
    generate(other, ids)
    tokens, logits = generate(model, ids)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits)
