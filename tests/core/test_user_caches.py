"""A cache the caller brings: evicted into (dynamic caches), or refused before prefill with the supported way.

Every cache type transformers 5 offers, passed as ``past_key_values`` or made by ``generate`` from
``cache_implementation``; never a silent full cache.
"""

from __future__ import annotations

import pytest
import torch
import transformers.cache_utils as cache_utils
from transformers.cache_utils import DynamicCache, QuantizedCache, StaticCache

import restkv
from helpers import generate, prompt, tiny_model

KNOBS = dict(method="snapkv", max_capacity_prompt=16, window_size=4)


def _model(family="llama", **overrides):
    model = tiny_model(family, "sdpa", **overrides)
    restkv.configure(model, **KNOBS)
    return model


def _first_layer_ran(model):
    """A flag set when the first decoder layer's MLP runs (the refusal must come before)."""
    ran = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: ran.append(True))
    return ran


@pytest.mark.parametrize("family, make", [
    ("llama", lambda m: DynamicCache()),
    ("llama", lambda m: DynamicCache(config=m.config)),
    ("mistral", lambda m: DynamicCache(config=m.config)),  # sliding-window layers (DynamicSlidingWindowLayer)
], ids=["dynamic", "dynamic-config", "dynamic-sliding"])
def test_dynamic_caches_are_evicted_into(family, make):
    model = _model(family, **({"sliding_window": 24} if family == "mistral" else {}))
    ids = prompt(80)
    ref, _ = generate(model, ids)
    ref_kept = restkv.kept_positions(model)
    cache = make(model)
    tokens, _ = generate(model, ids, past_key_values=cache)
    kept = restkv.kept_positions(model)
    assert torch.equal(tokens, ref) and all(torch.equal(a, b) for a, b in zip(kept, ref_kept))
    assert all(k is not None and k.shape[-1] == 16 for k in kept)
    assert all(layer.keys.shape[-2] < 80 for layer in cache.layers)


QUANT = "quant_method='quanto' or 'hqq'"
STATIC = "do not set cache_implementation='static'"


@pytest.mark.parametrize("make, what", [
    (lambda m: StaticCache(config=m.config, max_cache_len=100), STATIC),
    (lambda m: QuantizedCache("quanto", m.config), QUANT),
    (lambda m: QuantizedCache("hqq", m.config), QUANT),
    (lambda m: QuantizedCache("fp8", m.config), QUANT),
], ids=["static", "quanto", "hqq", "fp8"])
def test_caches_that_cannot_be_evicted_into_are_refused_before_prefill(make, what, request):
    if request.node.callspec.id == "fp8" and not hasattr(cache_utils, "Fp8QuantizedLayer"):
        pytest.skip("this transformers has no fp8 quantized cache (5.17)")
    model = _model()
    generate(model, prompt(60))  # an earlier run's kept positions must not linger
    cache = make(model)
    ran = _first_layer_ran(model)
    with pytest.raises(ValueError, match=rf"past_key_values: restkv evicts into the model's DynamicCache, not a "
                                         rf"{type(cache).__name__}.*{what}"):
        generate(model, prompt(80), past_key_values=cache)
    assert not ran and cache.get_seq_length() == 0
    assert restkv.kept_positions(model)[0] is None


@pytest.mark.parametrize("implementation, extra, what", [
    ("static", {}, STATIC),
    ("sliding_window", {}, STATIC),  # deprecated: a StaticCache
    ("quantized", {"cache_config": {"backend": "quanto", "nbits": 4}}, QUANT),
    ("quantized", {"cache_config": {"backend": "hqq", "nbits": 4}}, QUANT),
])
def test_cache_implementations_of_generate_are_refused_too(implementation, extra, what):
    model = _model()
    with pytest.raises(ValueError, match=what):
        generate(model, prompt(80), cache_implementation=implementation, **extra)


def test_the_dynamic_cache_implementation_is_evicted_into():
    model = _model()
    ids = prompt(80)
    ref, _ = generate(model, ids)
    tokens, _ = generate(model, ids, cache_implementation="dynamic")
    assert torch.equal(tokens, ref) and restkv.kept_positions(model)[0].shape[-1] == 16


def test_static_sliding_window_layers_are_refused():
    model = _model("mistral", sliding_window=24)
    with pytest.raises(ValueError, match=r"StaticCache \(StaticSlidingWindowLayer layers\)"):
        generate(model, prompt(80), past_key_values=StaticCache(config=model.config, max_cache_len=100))


def test_an_offloaded_cache_is_refused():
    """Offloading needs CUDA streams in transformers; the refusal comes first (checked on a flagged cache)."""
    model = _model()
    cache = DynamicCache(config=model.config)
    cache.offloading = True
    with pytest.raises(ValueError, match="offloaded.*offload the model's layers instead"):
        generate(model, prompt(80), past_key_values=cache)


def test_any_cache_serves_a_config_that_keeps_everything():
    model = tiny_model("llama", "sdpa")
    ids = prompt(80)
    ref, _ = generate(model, ids, past_key_values=StaticCache(config=model.config, max_cache_len=100))
    restkv.configure(model, method="fullkv")
    tokens, _ = generate(model, ids, past_key_values=StaticCache(config=model.config, max_cache_len=100))
    assert torch.equal(tokens, ref)
