"""Scores in float32 whatever the caller's ``torch.autocast``, TF32 setting or default dtype: every score
computed during ``generate()`` equals the same method's score of the same observation computed in plain
float32, and the caller's settings are as they were afterwards."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from helpers import prompt, tiny_model
from test_registry import EVICTING, knobs_for

import restkv
import restkv.eviction.select as select_module
from restkv.methods import REGISTRY


@pytest.fixture
def scored(monkeypatch):
    """Every ``raw_scores`` call during the test: (observation, config, scores, settings inside)."""
    calls = []
    original = select_module.raw_scores

    def spy(obs, cfg):
        out = original(obs, cfg)
        inside = (torch.is_autocast_enabled("cpu"), torch.backends.cuda.matmul.allow_tf32,
                  torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(), torch.get_default_dtype())
        calls.append((replace(obs, memo={}), cfg, out.clone(), inside))
        return out

    monkeypatch.setattr(select_module, "raw_scores", spy)
    return calls


def _settings():
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(), torch.get_default_dtype())


@contextlib.contextmanager
def tf32_allowed():
    saved = _settings()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("medium")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


@contextlib.contextmanager
def default_dtype(dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


SETTINGS = {
    "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "tf32": tf32_allowed,
    "default_float64": lambda: default_dtype(torch.float64),
    "default_bfloat16": lambda: default_dtype(torch.bfloat16),
}


def check_scores(calls):
    assert calls
    for obs, cfg, scores, inside in calls:
        assert inside == (False, False, False, "highest", torch.float32)
        assert scores.dtype == torch.float32
        ref = cfg.scorer.score(obs, cfg.score_knobs())  # the same observation, plain float32
        assert ref.dtype == torch.float32
        torch.testing.assert_close(scores, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("method", [m for m in EVICTING if not REGISTRY[m].replays])
def test_scores_are_float32_under_a_bf16_autocast(method, scored, tmp_path):
    model = tiny_model("llama")
    restkv.configure(model, **knobs_for(method, tmp_path))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.generate(prompt(48), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert not torch.is_autocast_enabled("cpu")
    check_scores(scored)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("knobs", [dict(method="snapkv"), dict(method="restkv"), dict(method="h2o"),
                                   dict(method="expected_attention"), dict(method="snapkv", decode_interval=2),
                                   dict(method="restkv", layer_budget="global")])
def test_scores_are_float32_whatever_the_callers_numerics(setting, knobs, scored):
    model = tiny_model("llama")
    restkv.configure(model, max_capacity_prompt=20, window_size=4, **knobs)
    before = _settings()
    with SETTINGS[setting]():
        inside_before = _settings()
        model.generate(prompt(48), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert _settings() == inside_before  # the caller's settings are restored after each eviction
    assert _settings() == before
    check_scores(scored)
