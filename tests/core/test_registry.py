"""Every registered method: the matrix a new method joins by its registry line, and the knob declarations.

- each method on a tiny model of every family: attached for a ``with`` block, generates, keeps its budget
  and the window, and leaves the model exactly as it was;
- a knob outside a method's declared score knobs (budgets, GQA reduction, merging, ...) leaves its raw
  scores unchanged (what makes sweep mode's score memo safe);
- a knob the method does not read raises, naming the knob and the method.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (FAMILIES, SMALL_MODEL, generate, masked_reference_logits, prompt, random_weights, rope_embed,
                     small, tiny_model)

import restkv
from restkv.strategies.budgets import layer_budgets
from restkv.config import CompressionConfig, declared
from restkv.eviction.plans import is_deferred
from restkv.methods import REGISTRY
from restkv.scoring.observe import Observation, wo_factor
from restkv.scoring.rope import Rope
from restkv.eviction.select import raw_scores

EVICTING = [m for m in restkv.METHODS if REGISTRY[m].evicts]


def head_table(path, layers=3, heads=6):
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(layers, heads, generator=g)
    path.write_text(json.dumps(scores.tolist()))
    return str(path)


def knobs_for(method, tmp_path, **extra):
    """Small-budget knobs any method accepts (HeadKV gets a table)."""
    if not REGISTRY[method].evicts:
        return dict(method=method)
    knobs = dict(method=method, max_capacity_prompt=20, window_size=4, **SMALL_MODEL.get(method, {}), **extra)
    if declared(method)["head_budget"].default == "headkv":
        knobs["head_importance"] = head_table(tmp_path / "heads.json")
    return knobs


def _hooks(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def _attributes(model):
    return [sorted(vars(m)) for m in model.modules()]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", list(restkv.METHODS))
def test_every_method_on_every_family_in_a_with_block(family, method, tmp_path):
    model = tiny_model(family, "sdpa")
    if small(method, family) is None:
        pytest.skip(f"{method} cannot run on the tiny {family} model")
    ids = prompt(48)
    plain_tokens, plain_logits = generate(model, ids, n=3)
    hooks, attributes = _hooks(model), _attributes(model)
    with restkv.compressing(model, **knobs_for(method, tmp_path)) as cfg:
        tokens, logits = generate(model, ids, n=3)
        kept = restkv.kept_positions(model)
    assert torch.isfinite(logits).all()
    layers = [k for k in kept if k is not None]  # sliding-window layers keep their own cache
    assert layers
    for k in layers:
        assert k.shape[:2] == (1, 2) and (k.shape[-1] < 48 if cfg.evicts else k.shape[-1] == 48)
        for head in k[0]:
            assert torch.isin(torch.arange(44, 48), head).all()  # the window is always kept
    assert _hooks(model) == hooks and _attributes(model) == attributes
    assert not hasattr(model, "_restkv")
    after_tokens, after_logits = generate(model, ids, n=3)
    assert torch.equal(after_tokens, plain_tokens) and torch.equal(after_logits, plain_logits)


def test_compressing_restores_an_earlier_configuration():
    model = tiny_model("llama", "sdpa")
    ids = prompt(60)
    restkv.configure(model, method="snapkv", max_capacity_prompt=16, window_size=4)
    snap, _ = generate(model, ids)
    with restkv.compressing(model, method="streamingllm", max_capacity_prompt=16, window_size=4):
        stream, _ = generate(model, ids)
    again, _ = generate(model, ids)
    assert torch.equal(again, snap) and not torch.equal(stream, snap)
    assert model._restkv.cfg.method == "snapkv"
    restkv.detach(model)
    assert not any(hasattr(m, "_restkv") for m in model.modules())


def _alternatives(knob, cfg):
    """Values of ``knob`` other than the config's to try."""
    value = cfg.get(knob.name, knob.default)
    if knob.choices:
        return [c for c in knob.choices if c != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, (int, float)) and value is not None:
        return [type(value)(c) for c in (value * 2 + 1, value / 2, value + 0.5)]
    return []


def _conditions(knob, knobs=None):
    """Values of the knobs that make ``knob`` read (its ``when`` clause, and theirs: ``knobs`` the declared ones)."""
    out = {}
    for k, allowed in knob.when:
        if knobs is not None and k in knobs:
            out.update(_conditions(knobs[k], knobs))
        out[k] = allowed[0]
    return out


def _scores(cfg, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, 8, generator=g) for h in (4, 2, 2))
    budget = layer_budgets(cfg, 3, n)[0]
    W = torch.randn(16, 32, generator=g)
    obs = Observation(q, k, v, torch.ones(1, n, dtype=torch.bool), window=cfg.window_size, budget=budget,
                      scaling=8**-0.5, wo_factor=wo_factor(W, 4), wo_weight=W, num_layers=3,
                      rope=Rope.of(rope_embed(8), torch.arange(n)[None]))
    if cfg.scorer.reads_hidden:  # a trained method: hidden states and weights of its model
        obs.hidden = torch.randn(1, n, 16, generator=g)
        obs.data = random_weights(cfg, 16, 2, 2)
    return raw_scores(obs, cfg)


BUDGET_KNOBS = ("max_capacity_prompt", "layer_budget", "beta")  # change obs.budget


def _changed_scores(method, tmp_path):
    """(knobs outside the method's score declaration whose change changed its raw scores, knobs tried)."""
    base = dict(method=method, max_capacity_prompt=16, window_size=4, **SMALL_MODEL.get(method, {}))
    if declared(method)["head_budget"].default == "headkv":
        base["head_importance"] = head_table(tmp_path / "heads.json")
    cfg = CompressionConfig(**base)
    reference = _scores(cfg)
    score_knobs = set(cfg.score_knobs())
    reads_budget = cfg.scorer.uses_budget(cfg.score_knobs())
    changed, tried = [], []
    for name, knob in declared(method).items():
        if name in score_knobs or name == "window_size" or (reads_budget and name in BUDGET_KNOBS):
            continue
        for value in _alternatives(knob, cfg):
            conditions = _conditions(knob, declared(method))
            knobs = {**base, **{k: v for k, v in conditions.items() if k not in score_knobs}, name: value}
            if knobs.get("quant_method"):
                continue  # quantization needs an optional package, and only stores the kept entries
            if knobs.get("head_budget") == "headkv":
                knobs["head_importance"] = head_table(tmp_path / "heads.json")
            try:
                other = CompressionConfig(**knobs)
            except ValueError:
                continue  # not a combination this method accepts
            tried.append(name)
            if not torch.equal(_scores(other), reference):
                changed.append(name)
            break
    return changed, tried


@pytest.mark.parametrize("method", EVICTING)
def test_knobs_outside_the_score_declaration_leave_the_scores_unchanged(method, tmp_path):
    changed, tried = _changed_scores(method, tmp_path)
    assert not changed and len(tried) >= 5, (changed, tried)


def test_an_undeclared_read_of_the_budget_is_caught(monkeypatch, tmp_path):
    from restkv.methods import snapkv

    honest = snapkv.score
    monkeypatch.setattr(snapkv, "score", lambda obs, cfg: honest(obs, cfg) + obs.budget)
    changed, _ = _changed_scores("snapkv", tmp_path)
    assert "max_capacity_prompt" in changed and "layer_budget" in changed


@pytest.mark.parametrize("method", EVICTING)
def test_a_knob_the_method_does_not_read_raises_naming_it(method):
    readers = {n for m in restkv.METHODS for n in declared(m)} - set(declared(method))
    for name in sorted(readers):
        knob = next(declared(m)[name] for m in restkv.METHODS if name in declared(m))
        with pytest.raises(ValueError, match=rf"{name} is not a knob of method {method}"):
            CompressionConfig(method=method, **{name: knob.default})


@pytest.mark.parametrize("method", EVICTING)
def test_every_method_refines_its_set(method, tmp_path):
    model = tiny_model("llama", "eager")
    ids = prompt(48)
    if is_deferred(CompressionConfig.from_kwargs(**knobs_for(method, tmp_path))):  # a selection across layers
        with pytest.raises(ValueError, match="refine_rounds"):
            CompressionConfig.from_kwargs(**knobs_for(method, tmp_path, refine_rounds=2))
        return
    with restkv.compressing(model, **knobs_for(method, tmp_path)):
        generate(model, ids, n=1)
        plain = restkv.kept_positions(model)
    with restkv.compressing(model, **knobs_for(method, tmp_path, refine_rounds=2, refine_pool=8)) as cfg:
        _, logits = generate(model, ids, n=3)
        kept = restkv.kept_positions(model)
    for a, b in zip(kept, plain):  # every head keeps its count and the window
        assert torch.equal((a >= 0).sum(-1), (b >= 0).sum(-1)) and torch.isin(torch.arange(44, 48), a).all()
    if cfg.merge == "none":  # merged values are not the full cache's
        torch.testing.assert_close(logits, masked_reference_logits(model, ids, kept, 3), rtol=1e-4, atol=1e-4)
