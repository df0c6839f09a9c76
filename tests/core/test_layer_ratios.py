"""``layer_ratios`` (kvpress's PerLayerCompressionPress): each evicted layer keeps its own budget,
and keeps what a uniform budget of that size keeps in that layer."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    generate,
    masked_reference_logits,
    prompt,
    sweep_equals_separate_runs,
    tiny_model,
)
from test_decode_eviction import decode

import restkv
from restkv.config import CompressionConfig
from restkv.strategies.budgets import ratio_budgets

N, WINDOW = 80, 8


def kept_after_prefill(model, ids, **knobs):
    restkv.configure(model, method="snapkv", window_size=WINDOW, **knobs)
    generate(model, ids, n=1)
    return restkv.kept_positions(model)


@pytest.mark.parametrize(
    "given, budgets",
    [
        (
            "0.5,0.25,0.95",
            [int(N * 0.5), int(N * 0.75), WINDOW + 1],
        ),  # kvpress: int(L (1 - r)), here >= window + 1
        ("30,20,9", [30, 20, 9]),
        ("0.0,0.1,0.3", [N, int(N * 0.9), int(N * 0.7)]),
    ],
)
def test_each_layer_keeps_its_budget_and_what_that_uniform_budget_keeps(given, budgets):
    model = tiny_model()
    ids = prompt(N)
    kept = kept_after_prefill(model, ids, layer_ratios=given)
    for layer, budget in enumerate(budgets):
        assert kept[layer].shape[-1] == budget, (layer, kept[layer].shape)
        alone = kept_after_prefill(model, ids, max_capacity_prompt=budget) if budget < N else None
        same = torch.arange(N).expand_as(kept[layer]) if alone is None else alone[layer]
        assert torch.equal(kept[layer], same), layer


def test_the_budgets_follow_kvpress_int_of_the_kept_fraction():
    cfg = CompressionConfig(method="snapkv", window_size=4, layer_ratios="0.3,0.7,0.999,0")
    for length in (10, 37, 1000):
        want = [min(length, max(5, int(length * (1 - r)))) for r in (0.3, 0.7, 0.999, 0.0)]
        assert ratio_budgets(cfg, length) == want


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(layer_ratios="0.5,2"), "layer_ratios must be comma-separated"),
        (dict(layer_ratios="0.5,x,0.1"), "layer_ratios must be comma-separated"),
        (dict(layer_ratios="1.0,0.5,0.5"), "layer_ratios must be comma-separated"),
        (dict(layer_ratios="20,8,30"), "larger than window_size"),
        (dict(layer_ratios="0.5,0.5,0.5", layer_budget="pyramid"), "layer_ratios"),
        (
            dict(layer_ratios="0.5,0.5,0.5", max_capacity_prompt_ratio=0.5),
            "max_capacity_prompt_ratio",
        ),
        (dict(layer_ratios="0.5,0.5"), r"one value per evicted layer \(3\), got 2"),
    ],
)
def test_bad_layer_ratios_are_refused_before_any_work(knobs, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        restkv.configure(model, method="snapkv", window_size=WINDOW, **knobs)


def test_decoding_keeps_each_layer_within_its_own_budget():
    """With ``decode_interval``, each layer is cut back to its own budget (held <= budget +
    interval), and the logits are the full cache's masked to what each layer holds."""
    model = tiny_model("llama", "eager", seed=3)
    ids = torch.cat([prompt(50, seed=1), prompt(50, seed=2)])
    restkv.configure(
        model, method="snapkv", window_size=6, decode_interval=4, layer_ratios="0.5,0.25,0.7"
    )
    logits, held, _ = decode(model, ids, 14, record=True)
    budgets = torch.tensor([25, 37, 15])  # int(50 (1 - r))
    lengths = torch.stack(
        [torch.stack([(p >= 0).sum(-1) for p in step]) for step in held]
    )  # [steps, layers, b, H]
    assert (lengths <= budgets[None, :, None, None] + 4).all()
    assert (
        lengths.amin((0, 2, 3)) == budgets
    ).all()  # each layer back at its budget after an eviction
    ref = masked_reference_logits(model, ids, held, 14)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_sweep_mode_equals_configure_and_generate():
    model = tiny_model()
    configs = [
        dict(method="snapkv", window_size=WINDOW, layer_ratios="0.5,0.25,0.95"),
        dict(method="snapkv", window_size=WINDOW, max_capacity_prompt=30),
        dict(method="compactor", window_size=WINDOW, layer_ratios="40,20,12"),
    ]
    sweep_equals_separate_runs(model, prompt(N), configs, 4)
