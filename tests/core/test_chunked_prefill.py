"""Chunked prefill (``generate(..., prefill_chunk_size=N)``) evicts once, after the last chunk, over the whole
prompt: for every registered method the same kept positions, cache and tokens as the unchunked prefill."""

from __future__ import annotations

import pytest
import torch
from helpers import cache_of, prompt, tiny_model
from test_registry import knobs_for

import restkv


def run(model, ids, mask=None, n=4, **kw):
    """(tokens, logits, kept positions, every stored entry per layer) of a greedy ``generate``."""
    mask = torch.ones_like(ids) if mask is None else mask
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
    entries = []
    for layer in cache_of(out).layers:
        if hasattr(layer, "stored_entries"):
            keys, values, valid, positions = layer.stored_entries()
            entries.append((keys * valid[..., None], values * valid[..., None], positions))
        else:
            entries.append((layer.keys, layer.values, None))
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), restkv.kept_positions(model), entries


def assert_same(chunked, whole):
    tokens, logits, kept, entries = chunked
    assert torch.equal(tokens, whole[0])
    torch.testing.assert_close(logits, whole[1], rtol=1e-4, atol=1e-4)
    assert len(kept) == len(whole[2])
    for a, b in zip(kept, whole[2]):
        assert (a is None and b is None) or torch.equal(a, b)
    for (k, v, p), (k0, v0, p0) in zip(entries, whole[3]):
        assert k.shape == k0.shape
        torch.testing.assert_close(k, k0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v0, rtol=1e-4, atol=1e-5)
        assert (p is None and p0 is None) or torch.equal(p, p0)


@pytest.mark.parametrize("method", list(restkv.METHODS))
def test_chunked_prefill_equals_the_whole_prompt_for_every_method(method, tmp_path):
    model = tiny_model("llama")
    ids = prompt(60)
    with restkv.compressing(model, **knobs_for(method, tmp_path)):
        whole = run(model, ids)
        for chunk in (16, 25):  # 25 does not divide the prompt (25, 25, 10)
            assert_same(run(model, ids, prefill_chunk_size=chunk), whole)


def test_the_reported_case_kept_positions_describe_the_cache():
    """Per KV head budget + new tokens entries, not the prompt appended after the first chunk."""
    model = tiny_model("llama")
    ids = prompt(200)
    restkv.configure(model, method="snapkv", max_capacity_prompt=32, window_size=8)
    tokens, _, kept, entries = run(model, ids, n=5, prefill_chunk_size=64)
    for k, (keys, _, _) in zip(kept, entries):
        assert k.shape == (1, 2, 32)
        assert keys.shape[2] == 32 + 4  # the last new token is not fed back
    assert torch.equal(tokens, run(model, ids, n=5)[0])


@pytest.mark.parametrize("knobs", [dict(method="snapkv"), dict(method="adakv"), dict(method="snapkv", decode_interval=3),
                                   dict(method="restkv", layer_budget="global")])
def test_chunked_prefill_of_a_left_padded_batch(knobs):
    model = tiny_model("llama")
    ids = prompt(50, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    restkv.configure(model, max_capacity_prompt=20, window_size=4, **knobs)
    whole = run(model, ids, mask, n=6)
    assert_same(run(model, ids, mask, n=6, prefill_chunk_size=16), whole)


def test_chunked_prefill_on_a_model_with_sliding_window_layers():
    model = tiny_model("gemma3")  # sliding-window layers keep their own cache; the global layer evicts
    ids = prompt(60)
    restkv.configure(model, method="snapkv", max_capacity_prompt=20, window_size=4)
    assert_same(run(model, ids, prefill_chunk_size=16), run(model, ids))


def test_chunked_prefill_is_refused_before_any_forward_where_only_sliding_windows_evict():
    model = tiny_model("mistral", sliding_window=32)
    restkv.configure(model, method="snapkv", max_capacity_prompt=20, window_size=4)
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        run(model, prompt(60), prefill_chunk_size=16)
    assert not calls
