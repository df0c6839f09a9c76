"""``decode_compression_ratio`` (kvpress's ``CompressionRatioDecodingPress``): each eviction
while decoding keeps a share of the tokens seen so far, checked step by step against a loop of
the reference's rule."""

from __future__ import annotations

import pytest
import torch

import restkv
from restkv.config import CompressionConfig
from helpers import CACHE, cache_of, prompt, tiny_model

B, W, INTERVAL = 24, 6, 4


def reference_sizes(real_length: int, steps: int, ratio: float) -> list[int]:
    """Entries a head holds after each decoded token: kvpress's target ``max(1, int(n (1 - r)))`` of
    the n tokens seen, applied every INTERVAL tokens (restkv's budget holds the window: at least W +
    1)."""
    held = min(B, real_length)
    since = 0
    out = []
    for t in range(1, steps + 1):
        held += 1
        since += 1
        if since >= INTERVAL:
            seen = real_length + t
            target = max(W + 1, max(1, int(seen * (1 - ratio))))
            held = min(held, target)
            since = 0
        out.append(held)
    return out


@pytest.mark.parametrize("method", ["snapkv", "h2o", "adakv"])
def test_each_eviction_keeps_a_share_of_the_tokens_seen(method):
    model = tiny_model("llama", "sdpa")
    ratio, steps, pad = 0.75, 14, 9
    ids = torch.cat([prompt(60, seed=1), prompt(60, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    restkv.configure(
        model,
        method=method,
        max_capacity_prompt=B,
        window_size=W,
        decode_interval=INTERVAL,
        decode_compression_ratio=ratio,
    )
    out = model(ids, attention_mask=mask, use_cache=True)
    cache = cache_of(out)
    held = []
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        tok = out.logits[:, -1:].argmax(-1)
        out = model(tok, attention_mask=mask, use_cache=True, **{CACHE(model): cache})
        per_layer = [layer.stored_entries()[2].sum(-1) for layer in cache.layers]  # [b, H]
        held.append(torch.stack(per_layer))  # [layers, b, H]
    held = torch.stack(held)  # [steps, layers, b, H]
    for sample, real in enumerate((60, 60 - pad)):
        expected = torch.tensor(reference_sizes(real, steps, ratio))
        if method == "adakv":  # heads share the layer's budget: the mean head holds it
            got = held[:, :, sample].float().mean(-1)
            assert torch.equal(got, expected[:, None].float().expand_as(got))
        else:
            assert torch.equal(
                held[:, :, sample], expected[:, None, None].expand_as(held[:, :, sample])
            )
    assert (
        reference_sizes(60, steps, ratio)[3] == 16
    )  # int(64 * 0.25): the share, not the prefill's 24


def test_without_the_ratio_the_prefill_budget_stays():
    model = tiny_model("llama", "sdpa")
    restkv.configure(
        model, method="snapkv", max_capacity_prompt=B, window_size=W, decode_interval=INTERVAL
    )
    out = model(prompt(60), use_cache=True)
    cache = cache_of(out)
    for _ in range(8):
        out = model(out.logits[:, -1:].argmax(-1), use_cache=True, **{CACHE(model): cache})
    assert all(int(layer.stored_entries()[2].sum(-1).max()) == B for layer in cache.layers)


def test_the_ratio_is_refused_where_it_cannot_act():
    with pytest.raises(ValueError, match="decode_compression_ratio acts while decoding"):
        CompressionConfig(method="snapkv", decode_compression_ratio=0.5)
    with pytest.raises(ValueError, match="decode_compression_ratio must be in"):
        CompressionConfig(method="snapkv", decode_interval=8, decode_compression_ratio=1.0)
    with pytest.raises(ValueError, match="layer_ratios"):
        CompressionConfig(
            method="snapkv",
            decode_interval=8,
            decode_compression_ratio=0.5,
            layer_ratios="0.5,0.5,0.5",
        )
