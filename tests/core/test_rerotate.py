"""``rerotate_keys`` (kvpress's ``KeyRerotationPress``): the kept keys against kvpress's rotation by
the position shift, written as explicit float64 RoPE matrices, on a model; generate and eviction
while decoding on it."""

from __future__ import annotations

import pytest
import torch
from helpers import CACHE, cache_of, capture, generate, prompt, tiny_model
from test_methods_2026 import rotation

import restkv
from restkv.config import CompressionConfig

B, W, L = 20, 4, 60


def shifted(k, kept, targets):
    """kvpress's rule: the key of position p moved to position t is R(t - p) k (float64 matrices).
    k [H, L, d], kept [H, c] positions, targets [H, c] -> [H, c, d]."""
    d = k.shape[-1]
    out = torch.zeros(*kept.shape, d, dtype=torch.float64)
    for h in range(kept.shape[0]):
        for j in range(kept.shape[1]):
            p, t = int(kept[h, j]), int(targets[h, j])
            out[h, j] = rotation(t - p, d) @ k[h, p]
    return out


@pytest.mark.parametrize("mode", ["start", "end"])
@pytest.mark.parametrize(
    "knobs", [dict(method="l2norm"), dict(method="snapkv"), dict(method="adakv")]
)
def test_kept_keys_are_moved_by_their_position_shift(mode, knobs):
    model = tiny_model("llama", "sdpa")
    ids = prompt(L)
    keys = {layer: k[0] for layer, (_, k, _) in capture(model, ids).items()}
    restkv.configure(model, max_capacity_prompt=B, window_size=W, rerotate_keys=mode, **knobs)
    cache = cache_of(model(ids, use_cache=True))
    kept = restkv.kept_positions(model)
    for layer, k in keys.items():
        held, _, valid, _ = cache.layers[layer].stored_entries()
        for h in range(k.shape[0]):
            positions = kept[layer][0, h][valid[0, h]]
            c = positions.numel()
            targets = torch.arange(c) + (0 if mode == "start" else L - c)
            ref = shifted(k[h : h + 1], positions[None], targets[None])[0]
            torch.testing.assert_close(held[0, h][valid[0, h]].double(), ref, rtol=1e-4, atol=1e-5)
    restkv.detach(model)


def test_the_kept_set_and_the_window_stay():
    model = tiny_model("llama", "sdpa")
    ids = prompt(L)
    restkv.configure(model, method="snapkv", max_capacity_prompt=B, window_size=W)
    plain = cache_of(model(ids, use_cache=True))
    positions = restkv.kept_positions(model)
    restkv.configure(
        model, method="snapkv", max_capacity_prompt=B, window_size=W, rerotate_keys="end"
    )
    moved = cache_of(model(ids, use_cache=True))
    assert all(torch.equal(a, b) for a, b in zip(positions, restkv.kept_positions(model)))
    for a, b in zip(plain.layers, moved.layers):
        assert torch.equal(a.keys[..., -W:, :], b.keys[..., -W:, :]), (
            "the window keeps its positions"
        )
        assert not torch.allclose(a.keys[..., :-W, :], b.keys[..., :-W, :])
        assert torch.equal(a.values, b.values)
    restkv.detach(model)


def test_nothing_evicted_is_nothing_moved_and_generate_runs():
    model = tiny_model("llama", "sdpa")
    ids = torch.cat([prompt(L, seed=1), prompt(L, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    restkv.configure(model, method="snapkv", max_capacity_prompt=B, window_size=W)
    plain = generate(model, ids, mask, n=6)
    for mode in ("start", "end"):
        restkv.configure(
            model, method="snapkv", max_capacity_prompt=B, window_size=W, rerotate_keys=mode
        )
        tokens, logits = generate(model, ids, mask, n=6)
        assert tokens.shape == plain[0].shape and torch.isfinite(logits).all()
        assert not torch.allclose(logits, plain[1])
        restkv.configure(
            model, method="snapkv", max_capacity_prompt=2 * L, window_size=W, rerotate_keys=mode
        )
        full = generate(model, ids, mask, n=6)
        restkv.configure(model, method="snapkv", max_capacity_prompt=2 * L, window_size=W)
        assert torch.equal(full[0], generate(model, ids, mask, n=6)[0])
    restkv.detach(model)


def test_decoding_evictions_pack_the_held_keys_before_the_newest():
    """Layer 0's keys depend on the tokens only, so a plain forward of the whole sequence gives each
    held entry's original key: every held key is it moved to the packed position before the newest
    token."""
    model = tiny_model("llama", "sdpa")
    ids = prompt(L)
    interval, steps = 4, 10
    restkv.configure(
        model,
        method="snapkv",
        max_capacity_prompt=B,
        window_size=W,
        decode_interval=interval,
        rerotate_keys="end",
    )
    out = model(ids, use_cache=True)
    cache = cache_of(out)
    seq = ids
    for _ in range(steps):
        tok = out.logits[:, -1:].argmax(-1)
        seq = torch.cat([seq, tok], 1)
        out = model(tok, use_cache=True, **{CACHE(model): cache})
    held, _, valid, positions = cache.layers[0].stored_entries()
    restkv.detach(model)
    k = capture(model, seq)[0][1][0]  # [H, n, d] float64
    newest = seq.shape[1] - 1
    for h in range(k.shape[0]):
        mine = positions[0, h][valid[0, h]]
        c = mine.numel()
        assert c < B + interval and int(mine.max()) == newest
        ref = shifted(k[h : h + 1], mine[None], (torch.arange(c) + newest - c + 1)[None])[0]
        torch.testing.assert_close(held[0, h][valid[0, h]].double(), ref, rtol=1e-4, atol=1e-5)


def test_refusals():
    with pytest.raises(ValueError, match="rerotate_keys='start'.*decode_interval"):
        CompressionConfig(method="snapkv", rerotate_keys="start", decode_interval=8)
    with pytest.raises(ValueError, match="rerotate_keys must be one of"):
        CompressionConfig(method="snapkv", rerotate_keys="yes")
    with pytest.raises(ValueError, match="rerotate_keys must be a str"):
        CompressionConfig(method="snapkv", rerotate_keys=True)
