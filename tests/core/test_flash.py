"""The flash-attention path on CPU: transformers' own flash wrapper (unpadding, ``cu_seqlens``, the 2D padding
mask) with a plain-torch kernel (``tests/flash_reference.py``) gives sdpa's tokens and kept positions for
every registered method, a left-padded batch, a sample shorter than the budget, the packed per-head layout,
decoding-time eviction, sweep mode, compressed contexts, a sliding-window model and a hub kernel's name."""

from __future__ import annotations

import pytest
import torch
from flash_reference import CALLS, flash_model, reference_flash
from helpers import CACHE, prompt, tiny_model
from test_registry import knobs_for

import restkv

HUB = "kernels-community/restkv-test-flash"  # a flash kernel registered under a hub name, as transformers does


def padded_batch(lengths=(60, 47)):
    """Left-padded prompts of ``lengths`` real tokens and their mask."""
    n = max(lengths)
    ids = torch.cat([prompt(n, seed=i + 1) for i in range(len(lengths))])
    mask = (torch.arange(n) >= n - torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def tokens_and_kept(model, ids, mask, knobs, n=6, **generate_kw):
    restkv.configure(model, **knobs)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, **generate_kw)
    kept = restkv.kept_positions(model)
    restkv.detach(model)
    return out[:, ids.shape[1]:], kept


def assert_flash_equals_sdpa(family, ids, mask, knobs, backend="flash_attention_2", n=6, **model_kw):
    sdpa = tokens_and_kept(tiny_model(family, "sdpa", **model_kw), ids, mask, knobs, n)
    before = dict(CALLS)
    with reference_flash(backend):
        flash = tokens_and_kept(flash_model(family, backend, **model_kw), ids, mask, knobs, n)
    assert CALLS != before  # the flash wrapper ran the reference kernels
    assert torch.equal(flash[0], sdpa[0]), knobs
    for a, b in zip(flash[1], sdpa[1]):
        assert (a is None and b is None) or torch.equal(a, b), knobs


@pytest.mark.parametrize("method", list(restkv.METHODS))
def test_every_method_on_flash_equals_sdpa(method, tmp_path):
    ids, mask = padded_batch((60,))
    assert_flash_equals_sdpa("llama", ids, mask, knobs_for(method, tmp_path))


@pytest.mark.parametrize("knobs", [
    dict(method="snapkv"),
    dict(method="restkv"),
    dict(method="adakv"),  # per-head budgets: the packed layout
    dict(method="restkv", gqa_agg="none"),  # one kept set per query head: packed
    dict(method="snapkv", max_capacity_prompt_ratio=0.5),  # budgets that differ by sample
    dict(method="snapkv", decode_interval=3),  # eviction while decoding
    dict(method="adakv", decode_interval=3),
    dict(method="restkv", layer_budget="global"),  # a deferred selection
    dict(method="snapkv", rerotate_keys="end"),  # kept keys re-rotated
    dict(method="adakv", rerotate_keys="end", decode_interval=3),
    dict(method="snapkv", compose="l2norm"),  # two methods in sequence
    dict(method="snapkv", prompt_chunk=16),  # a share of the budget per chunk
    dict(method="snapkv", prompt_block=16),  # block by block
    dict(method="snapkv", merge="value"),  # evicted values merged
    dict(method="snapkv", decode_interval=3, decode_compression_ratio=0.5),
])
def test_left_padded_batch_on_flash_equals_sdpa(knobs):
    ids, mask = padded_batch((60, 47))
    budget = {} if "max_capacity_prompt_ratio" in knobs else dict(max_capacity_prompt=20)
    knobs = dict(window_size=4, **budget, **knobs)
    assert_flash_equals_sdpa("llama", ids, mask, knobs, n=8)


def test_a_sample_shorter_than_the_budget_on_flash():
    ids, mask = padded_batch((60, 15))
    assert_flash_equals_sdpa("llama", ids, mask, dict(method="snapkv", max_capacity_prompt=20, window_size=4), n=8)


def test_headkv_table_on_flash(tmp_path):
    ids, mask = padded_batch((60, 47))
    knobs = knobs_for("headkv", tmp_path)
    assert_flash_equals_sdpa("llama", ids, mask, knobs, n=8)


@pytest.mark.parametrize("knobs", [dict(method="snapkv"), dict(method="adakv"), dict(method="restkv", gqa_agg="none")])
def test_sliding_window_model_on_flash(knobs):
    """Gemma 3: its sliding-window layers keep their own cache (prompt longer than the window), the global one evicts."""
    ids, mask = padded_batch((60, 47))
    assert_flash_equals_sdpa("gemma3", ids, mask, dict(max_capacity_prompt=20, window_size=4, **knobs), n=8)


def test_every_layer_sliding_window_on_flash():
    """Mistral v0.1's layout (every layer sliding-window): eviction among the window's entries, decoded past it."""
    ids, mask = padded_batch((60, 47))
    knobs = dict(method="snapkv", max_capacity_prompt=12, window_size=4)
    assert_flash_equals_sdpa("mistral", ids, mask, knobs, n=24, sliding_window=24)


def test_a_hub_kernel_name_is_accepted_and_evicts():
    ids, mask = padded_batch((60, 47))
    knobs = dict(method="adakv", max_capacity_prompt=20, window_size=4)
    assert_flash_equals_sdpa("llama", ids, mask, knobs, backend=HUB, n=8)
    assert_flash_equals_sdpa("llama", ids, mask, dict(knobs, method="snapkv"), backend="flash_attention_3", n=8)


def test_sweep_mode_on_flash():
    ids, mask = padded_batch((60, 47))
    configs = [dict(method="snapkv", max_capacity_prompt=20, window_size=4),
               dict(method="adakv", max_capacity_prompt=24, window_size=4)]
    expected = restkv.sweep(tiny_model("llama"), ids, mask, configs, 6, pad_token_id=0)
    with reference_flash():
        swept = restkv.sweep(flash_model("llama"), ids, mask, configs, 6, pad_token_id=0)
    for (tokens, kept), (ref_tokens, ref_kept) in zip(swept, expected):
        assert torch.equal(tokens, ref_tokens)
        assert all(a is None or torch.equal(a, b) for a, b in zip(kept, ref_kept))


@pytest.mark.parametrize("knobs", [dict(method="snapkv"), dict(method="adakv"), dict(method="snapkv", decode_interval=3)])
def test_compressed_context_on_flash(knobs):
    context, mask = padded_batch((60, 47))
    question = prompt(5, batch=2, seed=9)
    ids = torch.cat([context, question], 1)
    full_mask = torch.cat([mask, torch.ones_like(question)], 1)

    def ask(model):
        cache = restkv.compress_context(model, context, mask, max_capacity_prompt=20, window_size=4, **knobs)
        out = model.generate(ids, attention_mask=full_mask, max_new_tokens=6, do_sample=False, **{CACHE(model): cache},
                             pad_token_id=0)
        restkv.detach(model)
        return out[:, ids.shape[1]:]

    expected = ask(tiny_model("llama"))
    with reference_flash():
        assert torch.equal(ask(flash_model("llama")), expected)


def test_chunked_prefill_on_flash():
    ids, mask = padded_batch((60, 47))
    knobs = dict(method="snapkv", max_capacity_prompt=20, window_size=4)
    expected = tokens_and_kept(tiny_model("llama"), ids, mask, knobs, 6)
    with reference_flash():
        got = tokens_and_kept(flash_model("llama"), ids, mask, knobs, 6, prefill_chunk_size=16)
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))


def test_kvcompose_pass_in_several_forwards_on_flash(monkeypatch):
    """KVCompose's second reading in forwards of 7 tokens: flash's causal alignment of a forward after
    the held entries and the pass's earlier ones gives sdpa's tokens and kept entries."""
    from restkv.methods import kvcompose

    monkeypatch.setattr(kvcompose, "PASS_CHUNK", 7)
    ids, mask = padded_batch()
    knobs = dict(method="kvcompose", max_capacity_prompt=20, window_size=4)
    assert_flash_equals_sdpa("llama", ids, mask, knobs)
