"""Sweep mode (one prefill, many configs) equals separate configure + generate runs."""

from __future__ import annotations

import json

import pytest
import torch

import restkv
from helpers import tiny_model

CONFIGS = [
    dict(method="restkv", max_capacity_prompt=24, window_size=8),
    dict(method="snapkv", max_capacity_prompt=24, window_size=8),
    dict(method="pyramidkv", max_capacity_prompt=20, window_size=4),
    dict(method="h2o", max_capacity_prompt=32, window_size=8),
    dict(method="restkv", max_capacity_prompt=30, window_size=6, metric_mode="before", use_pyramid=True),
    dict(method="cam", max_capacity_prompt=24, window_size=8),
    dict(method="snapkv", max_capacity_prompt=24, window_size=8, merge="pivot"),
    dict(method="streamingllm", max_capacity_prompt=64, window_size=8),  # keeps all of the short sample
    dict(method="adakv", max_capacity_prompt=24, window_size=8),
    dict(method="fullkv"),
]
NEW = 6


def _separate(model, ids, mask, cfg, **gen):
    restkv.configure(model, **cfg)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **gen)
    return out[:, ids.shape[1]:], restkv.kept_positions(model)


def _batch(padded: bool):
    g = torch.Generator().manual_seed(4)
    if not padded:
        ids = torch.randint(3, 97, (1, 80), generator=g)
        return ids, torch.ones_like(ids)
    ids = torch.randint(3, 97, (2, 90), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :33], mask[1, :33] = 0, 0
    return ids, mask


def _assert_same(swept, separate, what):
    tokens, kept = swept
    ref_tokens, ref_kept = separate
    assert torch.equal(tokens, ref_tokens), what
    assert len(kept) == len(ref_kept)
    for layer, (k, r) in enumerate(zip(kept, ref_kept)):
        assert (k is None) == (r is None), (what, layer)
        if k is not None:
            assert torch.equal(k, r), (what, layer)


@pytest.mark.parametrize("padded", [False, True], ids=["batch1", "padded2"])
@pytest.mark.parametrize("family,backend", [("llama", "sdpa"), ("qwen2", "eager"), ("gemma3", "sdpa")])
def test_sweep_equals_separate_runs(family, backend, padded):
    model = tiny_model(family, backend)
    ids, mask = _batch(padded)
    swept = restkv.sweep(model, ids, mask, CONFIGS, NEW, pad_token_id=0)
    assert len(swept) == len(CONFIGS)
    for cfg, result in zip(CONFIGS, swept):
        _assert_same(result, _separate(model, ids, mask, cfg), cfg)


def test_sweep_stops_at_eos_like_generate():
    model = tiny_model("llama", "sdpa")
    ids, mask = _batch(True)
    configs = CONFIGS[:3]
    plain = restkv.sweep(model, ids, mask, configs, NEW, eos_token_id=None)
    eos = int(plain[0][0][0, 2])  # stop sample 0 of the first config early
    swept = restkv.sweep(model, ids, mask, configs, NEW, eos_token_id=eos, pad_token_id=0)
    for cfg, result in zip(configs, swept):
        _assert_same(result, _separate(model, ids, mask, cfg, eos_token_id=eos), cfg)
    assert (swept[0][0][0, 3:] == 0).all()


def test_sweep_restores_the_model_configuration():
    model = tiny_model("llama", "sdpa")
    ids, mask = _batch(False)
    restkv.configure(model, method="snapkv", max_capacity_prompt=16, window_size=4)
    before = _separate(model, ids, mask, dict(method="snapkv", max_capacity_prompt=16, window_size=4))
    restkv.sweep(model, ids, mask, CONFIGS[:2], 3)
    assert model._restkv.cfg.method == "snapkv"
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(out[:, ids.shape[1]:], before[0])
    with pytest.raises(ValueError, match="unknown knob"):
        restkv.sweep(model, ids, mask, [dict(method="snapkv", budget=3)], 3)
    assert model._restkv.cfg.method == "snapkv"


def test_sweep_with_headkv_table(tmp_path):
    table = tmp_path / "heads.json"
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 6, generator=g)
    table.write_text(json.dumps({f"{l}-{h}": [float(scores[l, h]), 0.5] for l in range(3) for h in range(6)}))
    model = tiny_model("llama", "eager")
    ids, mask = _batch(True)
    configs = [dict(method="headkv", max_capacity_prompt=24, window_size=6, head_importance=str(table)),
               dict(method="snapkv", max_capacity_prompt=24, window_size=6)]
    for cfg, result in zip(configs, restkv.sweep(model, ids, mask, configs, NEW, pad_token_id=0)):
        _assert_same(result, _separate(model, ids, mask, cfg), cfg)


def test_batched_decode_drops_finished_rows_and_matches_separate_runs(monkeypatch):
    from restkv.integration import generation

    monkeypatch.setattr(generation, "CHECK_EVERY", 1)  # read the finished rows at every token (default: every 32)
    model = tiny_model("llama", "sdpa")
    ids, mask = _batch(True)
    configs = [c for c in CONFIGS if c["method"] in ("restkv", "snapkv", "h2o", "pyramidkv")]
    plain = restkv.sweep(model, ids, mask, configs, NEW, eos_token_id=None)
    firsts = {int(t) for tokens, _ in plain for t in tokens[:, 1]}
    eos = sorted(firsts - {int(plain[-1][0][-1, 1])})  # most rows stop at their 2nd token, the last one runs on
    sizes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    swept = restkv.sweep(model, ids, mask, configs, NEW, eos_token_id=eos, pad_token_id=0)
    hook.remove()
    assert sizes[0] == ids.shape[0] and sizes[1] == len(configs) * ids.shape[0]  # prefill, then one batch
    assert min(sizes[1:]) < sizes[1]  # finished rows left the batch
    for cfg, result in zip(configs, swept):
        _assert_same(result, _separate(model, ids, mask, cfg, eos_token_id=eos), cfg)
    unbatched = restkv.sweep(model, ids, mask, configs, NEW, eos_token_id=eos, pad_token_id=0, batch_configs=False)
    for (tokens, _), (ref, _) in zip(swept, unbatched):
        assert torch.equal(tokens, ref)
