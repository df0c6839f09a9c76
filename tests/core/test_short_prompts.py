"""Every registered method on prompts of every length: 1 token, shorter than the window, between the window
and the budget, just over the budget and far over it, with its default knobs and with a small budget and
window. A prompt the config keeps whole (``keeps_prompt``: it fits the budget, or lies in the window) gives
the unpatched model's tokens; a padded batch's one-token row gives the unpatched model's tokens on that
batch; eviction while decoding from a one-token prompt equals decoding on the full cache with the evicted
entries masked; a prompt kept whole is never scored."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers import SMALL_MODEL, generate, masked_reference_logits, prompt, tiny_model
from test_decode_eviction import decode

import restkv
from restkv.config import CompressionConfig, declared
from restkv.eviction import deferred
from restkv.eviction.plans import is_deferred
from restkv.methods import REGISTRY, Method
from restkv.strategies.budgets import keeps_prompt

SETTINGS = {"defaults": {}, "small": {"max_capacity_prompt": 64, "window_size": 16}}
NEW = 2  # new tokens per generation
# what a method needs to run on the 3-layer models (its own defaults otherwise: SimLayerKV's included)
NEEDS = {m: k for m, k in SMALL_MODEL.items() if m != "simlayerkv"}
LONGEST = 2 * 2048 + NEW  # the longest prompt (twice TriAttention's default budget) and its new tokens


def knobs(method, tmp_path, **extra) -> dict:
    """``method``'s knobs on the tiny models, ``extra`` (budget, window) when it evicts; HeadKV gets a table."""
    if not REGISTRY[method].evicts:
        return {"method": method}
    out = {"method": method, **NEEDS.get(method, {}), **extra}
    if declared(method)["head_budget"].default == "headkv":
        table = torch.rand(3, 6, generator=torch.Generator().manual_seed(0))
        (tmp_path / "heads.json").write_text(json.dumps(table.tolist()))
        out["head_importance"] = str(tmp_path / "heads.json")
    return out


def lengths(cfg) -> list[int]:
    """1 token, shorter than the window, between the window and the budget, just over and far over the budget."""
    W, B = cfg.window_size, cfg.max_capacity_prompt
    return sorted({1, max(1, W - 1), (W + B) // 2, B + 1, 2 * B})


@functools.cache
def model(attn="sdpa", copy=0):
    """The tiny Llama (``copy`` 1: another instance of the same weights, never configured)."""
    return tiny_model("llama", attn, max_position_embeddings=LONGEST)


@functools.cache
def plain(n: int, short_row: bool = False):
    """The unpatched model's tokens on ``prompt(n)`` (with ``short_row``: a batch of it and a one-token row,
    left-padded), from a model that restkv never touches."""
    ids, mask = batch_with_short_row(n) if short_row else (prompt(n), None)
    return generate(model("sdpa", copy=1), ids, mask, n=NEW)[0]


def batch_with_short_row(n: int):
    """[2, n] ids and mask: ``prompt(n)`` and a one-token row left-padded to it."""
    ids = torch.cat([prompt(n), prompt(n, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :-1] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.fixture(autouse=True)
def _detached():
    yield
    restkv.detach(model())


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", list(restkv.METHODS))
def test_every_method_generates_on_every_prompt_length(method, setting, tmp_path):
    cfg = restkv.configure(model(), **knobs(method, tmp_path, **SETTINGS[setting]))
    for n in lengths(cfg):
        tokens, logits = generate(model(), prompt(n), n=NEW)
        assert torch.isfinite(logits).all(), n
        if keeps_prompt(cfg, n):
            assert torch.equal(tokens, plain(n)), n
    if setting == "small":  # a padded batch whose second row is one token: kept whole
        far = lengths(cfg)[-1]
        tokens, logits = generate(model(), *batch_with_short_row(far), n=NEW)
        assert torch.isfinite(logits).all()
        assert torch.equal(tokens[1], plain(far, short_row=True)[1])


@pytest.mark.parametrize("method", [m for m in restkv.METHODS if REGISTRY[m].evicts])
def test_a_prompt_kept_whole_is_never_scored(method, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("scored a prompt kept whole")

    cfg = restkv.configure(model(), **knobs(method, tmp_path, **SETTINGS["small"]))  # calibrated first
    monkeypatch.setattr(Method, "score", refuse)
    monkeypatch.setattr(deferred, "replay_scores", refuse)  # the passes after the prefill (KVzip)
    whole = [n for n in (1, 15, 16, 64) if keeps_prompt(cfg, n)]
    assert whole[:3] == [1, 15, 16]  # the window's at least
    for n in whole:
        assert torch.equal(generate(model(), prompt(n), n=NEW)[0], plain(n)), n


B, W, INTERVAL = 8, 2, 2


@pytest.mark.parametrize("method", [m for m in restkv.METHODS if REGISTRY[m].evicts])
def test_every_method_evicts_while_decoding_from_one_token(method, tmp_path):
    own = knobs(method, tmp_path, max_capacity_prompt=B, window_size=W)
    if is_deferred(CompressionConfig(**own)) or REGISTRY[method].reads_hidden:  # refused, naming the knob
        with pytest.raises(ValueError, match="decode_interval"):
            CompressionConfig(**own, decode_interval=INTERVAL)
        return
    eager = model("eager")
    cfg = restkv.configure(eager, **own, decode_interval=INTERVAL)
    try:
        ids = prompt(1)
        logits, held, cache = decode(eager, ids, 16, record=True)
        assert all(layer.policy.budgets == (B,) for layer in cache.layers)  # a prompt within it: B per layer
        assert all(int((p >= 0).sum()) < p.shape[1] * 15 for p in held[-1]), "every layer evicted"
        if cfg.get("merge", "none") == "none":  # merged values are not the full cache's
            torch.testing.assert_close(logits, masked_reference_logits(eager, ids, held, 16), rtol=1e-4, atol=1e-4)
    finally:
        restkv.detach(eager)


PER_SAMPLE = [  # budgets of each sample's own length: a one-token row is a part of its own, kept whole
    {"method": "simlayerkv"},
    {"method": "dms", **NEEDS["dms"]},
    {"method": "kvzip", **NEEDS["kvzip"]},
    {"method": "fastkvzip", **NEEDS["fastkvzip"]},
    {"method": "snapkv", "gqa_agg": "none"},  # the long row keeps a set per query head, the short one all
]


@pytest.mark.parametrize("own", PER_SAMPLE, ids=lambda k: k["method"] + ("_none" if "gqa_agg" in k else ""))
def test_a_per_sample_budget_keeps_a_one_token_row_whole(own):
    restkv.configure(model(), **own, max_capacity_prompt_ratio=0.5, window_size=2)
    tokens, logits = generate(model(), *batch_with_short_row(40), n=NEW)
    assert torch.isfinite(logits).all()
    assert torch.equal(tokens[1], plain(40, short_row=True)[1])
    assert (restkv.kept_positions(model())[0][1] >= 0).sum(-1).eq(1).all()  # its one entry, per head


def test_a_prompt_within_the_sinks_is_selected_without_passes():
    """KVzip's passes reconstruct what follows its sinks: a 3-token prompt under 4 sinks has none, and its
    budget of 2 (the ratio's floor) keeps, over 3 layers x 2 heads, every head's window and 6 entries more."""
    eager = model("eager")
    restkv.configure(eager, **NEEDS["kvzip"], method="kvzip", max_capacity_prompt_ratio=0.5, window_size=1)
    try:
        ids = prompt(3)
        _, logits = generate(eager, ids, n=NEW)
        kept = restkv.kept_positions(eager)
        assert all((k == 2).any(-1).all() for k in kept)  # the window
        assert sum(int((k >= 0).sum()) for k in kept) == 3 * 2 * 2
        torch.testing.assert_close(logits, masked_reference_logits(eager, ids, kept, NEW), rtol=1e-4, atol=1e-4)
    finally:
        restkv.detach(eager)
