"""The cross-layer budget with other scorers (Layer-DefensiveKV), what it refuses, and sweep mode for every method.

Layer-DefensiveKV against DefensiveKV's float64 loops (``test_methods_2026.defensive_loops``) on each layer of
a plain forward, the allocation by brute force over all layers; every registered method sweeps as it configures.
"""

from __future__ import annotations

import pytest
import torch

import restkv
from restkv.config import CompressionConfig
from restkv.scoring.observe import Observation
from helpers import capture, generate, masked_reference_logits, prompt, small, tiny_model
from test_deferred import HKV, LAYERS, assert_global_top
from test_methods_2026 import defensive_loops
from test_registry import head_table


def test_layer_defensivekv_keeps_the_top_defensive_scores_of_all_layers():
    model = tiny_model("llama", "eager")
    ids, budget, window = prompt(40), 14, 4
    restkv.configure(model, method="layer_defensivekv", max_capacity_prompt=budget, window_size=window)
    _, logits = generate(model, ids, n=4)
    kept = restkv.kept_positions(model)
    reference = []
    for layer, (q, k, v, scaling) in capture(model, ids, values=True).items():
        obs = Observation(q, k, v, torch.ones(1, 40, dtype=torch.bool), window=window, budget=budget, scaling=scaling)
        W = model.model.layers[layer].self_attn.o_proj.weight.double()
        reference.append(defensive_loops(obs, k, v, W, 5, 0.9)[0])
    reference = torch.stack(reference)  # [layers, Hkv, P], compared unnormalised across layers
    assert len({int((k >= 0).sum()) for k in kept}) > 1, "layers keep different numbers of entries"
    assert_global_top(kept, reference, window, LAYERS * HKV * (budget - window))
    torch.testing.assert_close(logits, masked_reference_logits(model, ids, kept, 4), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("knobs,knob", [
    (dict(method="snapkv", layer_budget="global", decode_interval=8), "decode_interval"),
    (dict(method="kvzip", decode_interval=8), "decode_interval"),
    (dict(method="snapkv", pruning_ratio=0.5, decode_interval=8), "decode_interval"),
    (dict(method="snapkv", layer_budget="global", gqa_agg="none"), "layer_budget='global'"),
], ids=["global", "kvzip", "pruned", "gqa-none"])
def test_unsupported_combinations_raise_naming_the_knob(knobs, knob):
    with pytest.raises(ValueError, match=knob):
        CompressionConfig(**small(knobs.pop("method"), max_capacity_prompt=20, window_size=4, **knobs))


@pytest.mark.parametrize("knobs", [dict(method="snapkv", layer_budget="global"), dict(method="kvzip"),
                                   dict(method="snapkv", pruning_ratio=0.5)], ids=["global", "kvzip", "pruned"])
def test_a_model_of_sliding_window_layers_refuses_them_before_any_work(knobs):
    model = tiny_model("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding-window"):
        restkv.configure(model, **small(knobs.pop("method"), max_capacity_prompt=20, window_size=4, **knobs))
    assert not any(hasattr(m, "_restkv") for m in model.modules())


@pytest.mark.parametrize("method", restkv.METHODS)
def test_every_method_sweeps_as_it_configures(method, tmp_path):
    model = tiny_model("llama", "sdpa")
    ids = prompt(64)
    cfg = small(method, max_capacity_prompt=24, window_size=4)
    if method == "headkv":
        cfg["head_importance"] = head_table(tmp_path / "heads.json")
    (tokens, kept), = restkv.sweep(model, ids, None, [cfg], 4, pad_token_id=0)
    restkv.configure(model, **cfg)
    ref, _ = generate(model, ids, n=4)
    assert torch.equal(tokens, ref)
    assert all((a is None) == (b is None) and (a is None or torch.equal(a, b))
               for a, b in zip(kept, restkv.kept_positions(model)))
