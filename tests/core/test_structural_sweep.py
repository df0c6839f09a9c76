"""Sweep mode with the structural strategies (``prompt_block``, ``compose``, ``prompt_chunk``,
``rerotate_keys``, ``decode_compression_ratio``): one prefill for all, each as configured alone."""

from __future__ import annotations

import pytest
import torch
from helpers import prompt, sweep_equals_separate_runs, tiny_model

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
