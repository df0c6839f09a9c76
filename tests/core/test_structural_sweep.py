"""Sweep mode and compressed contexts with the structural strategies (``prompt_block``, ``compose``,
``prompt_chunk``, ``rerotate_keys``, ``decode_compression_ratio``): one prefill for all, each as
configured alone; each question as if asked alone."""

from __future__ import annotations

import pytest
import torch
from helpers import prompt, sweep_equals_separate_runs, tiny_model
from test_context import ask, padded_context

import restkv

BASE = {"method": "snapkv", "max_capacity_prompt": 16, "window_size": 4}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_sweep_of_the_structural_strategies_equals_separate_runs(family):
    model = tiny_model(family, "sdpa")
    configs = [
        BASE,
        {**BASE, "prompt_block": 8},
        {**BASE, "compose": "l2norm"},
        {**BASE, "prompt_chunk": 10},
        {**BASE, "rerotate_keys": "end"},
        {**BASE, "rerotate_keys": "start"},
        {**BASE, "decode_interval": 2, "decode_compression_ratio": 0.8},
    ]
    swept = sweep_equals_separate_runs(model, prompt(50), configs, 5)
    kept = [k for _, k in swept]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b) if x is not None)

    assert not any(same(kept[0], kept[i]) for i in (1, 2, 3)), "blocks, compose, chunks choose"
    assert same(kept[0], kept[4]) and same(kept[0], kept[5]), "re-rotation keeps the kept set"


@pytest.mark.parametrize(
    "knobs",
    [
        {"prompt_block": 8},
        {"compose": "l2norm"},
        {"prompt_chunk": 10},
        {"rerotate_keys": "end", "decode_interval": 3},
        {"decode_interval": 3, "decode_compression_ratio": 0.7},
    ],
)
def test_a_compressed_context_answers_each_question_as_alone(knobs):
    """``compress_context`` with each strategy: question b after question a is answered as alone."""
    model = tiny_model("llama", "sdpa")
    context, mask = padded_context()
    qa, qb = prompt(5, batch=2, seed=7), prompt(9, batch=2, seed=8)
    knobs = {"method": "snapkv", "max_capacity_prompt": 24, "window_size": 6, **knobs}
    cache = restkv.compress_context(model, context, mask, **knobs)
    alone = ask(model, restkv.compress_context(model, context, mask, **knobs), context, mask, qb)
    ask(model, cache, context, mask, qa)
    assert torch.equal(ask(model, cache, context, mask, qb), alone)
