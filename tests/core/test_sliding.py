"""Eviction on a model whose every layer is sliding-window (Mistral v0.1's config, transformers' default).

A layer whose window covers the prompt is evicted as a full-attention layer; a shorter window limits the
candidates to the entries the first decoded token still sees (the last W - 1); decoding never attends an
entry more than W - 1 positions back. Reference: greedy decoding on the full cache under the model's
sliding-window mask with every evicted entry masked.
"""

from __future__ import annotations

import pytest
import torch

import restkv
from helpers import generate, masked_reference_logits, prompt, tiny_model

N, NEW = 80, 6
# windows: longer than prompt and decoding; covering the prompt but not the decoding; shorter than the prompt
WINDOWS = (200, 84, 24)
METHODS = ("restkv", "snapkv", "streamingllm", "h2o", "adakv")


def mistral(window, backend="eager"):
    return tiny_model("mistral", backend, sliding_window=window)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("method", METHODS)
def test_decoding_equals_the_masked_full_cache_under_the_window(method, window, backend):
    model = mistral(window, backend)
    ids = prompt(N)
    restkv.configure(model, method=method, max_capacity_prompt=16, window_size=4)
    _, logits = generate(model, ids, n=NEW)
    kept = restkv.kept_positions(model)
    assert all(k is not None and k.shape[-1] >= 16 for k in kept), "every layer is evicted"
    oldest = max(0, N - window + 1)  # what the first decoded token still sees
    assert all(int(k[k >= 0].min()) >= oldest for k in kept)
    assert all(bool((k[..., None] == torch.arange(N - 4, N)).any(-2).all()) for k in kept), "window kept"
    ref = masked_reference_logits(model, ids, kept, NEW, window=window)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_a_window_covering_prompt_and_decoding_evicts_as_full_attention(method):
    ids = prompt(N)
    out = []
    for window in (200, None):
        model = mistral(window)
        restkv.configure(model, method=method, max_capacity_prompt=16, window_size=4)
        tokens, logits = generate(model, ids, n=NEW)
        out.append((tokens, logits, restkv.kept_positions(model)))
    (t1, l1, k1), (t2, l2, k2) = out
    assert torch.equal(t1, t2) and all(torch.equal(a, b) for a, b in zip(k1, k2))
    torch.testing.assert_close(l1, l2)


@pytest.mark.parametrize("knobs", [dict(method="fullkv"), dict(method="snapkv", max_capacity_prompt=30, window_size=4)])
def test_nothing_to_evict_leaves_the_model_as_it_is(knobs):
    model = mistral(24)  # 23 visible entries: a budget of 30 keeps them all
    ids = prompt(N)
    ref_tokens, ref_logits = generate(model, ids, n=NEW)
    restkv.configure(model, **knobs)
    tokens, logits = generate(model, ids, n=NEW)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits)


def test_padded_batch_equals_single_runs_under_a_short_window():
    model = mistral(24)
    long, short = prompt(90, seed=2)[0], prompt(57, seed=3)[0]
    restkv.configure(model, method="snapkv", max_capacity_prompt=12, window_size=4)
    singles = []
    for seq in (long, short):
        tokens, _ = generate(model, seq[None], n=NEW)
        singles.append((tokens, [k.clone() for k in restkv.kept_positions(model)]))
    ids = torch.zeros(2, 90, dtype=torch.long)
    mask = torch.zeros(2, 90, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, -57:], mask[1, -57:] = short, 1
    tokens, _ = generate(model, ids, mask, n=NEW)
    for b, (single_tokens, single_kept) in enumerate(singles):
        assert torch.equal(tokens[b], single_tokens[0]), b
        for k, ks in zip(restkv.kept_positions(model), single_kept):
            assert torch.equal(k[b], ks[0])


def test_sweep_equals_configure_then_generate_under_a_short_window():
    model = mistral(24, "sdpa")
    ids = prompt(N)
    configs = [dict(method="restkv", max_capacity_prompt=b, window_size=4) for b in (12, 16)] + [
        dict(method="adakv", max_capacity_prompt=12, window_size=4), dict(method="fullkv")]
    swept = restkv.sweep(model, ids, None, configs, NEW, eos_token_id=None)
    for cfg, (tokens, kept) in zip(configs, swept):
        restkv.configure(model, **cfg)
        alone, _ = generate(model, ids, n=NEW)
        assert torch.equal(tokens, alone), cfg
        assert all(torch.equal(a, b) for a, b in zip(kept, restkv.kept_positions(model))), cfg


def test_one_set_per_query_head_is_refused_on_a_sliding_window():
    with pytest.raises(ValueError, match="gqa_agg='none'.*sliding window"):
        restkv.configure(mistral(24), method="restkv", max_capacity_prompt=16, window_size=4, gqa_agg="none")
