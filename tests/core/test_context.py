"""A context compressed once, many questions (``restkv.compress_context``)."""

from __future__ import annotations

import pytest
import torch

import restkv
from restkv.integration.context import ContextCache, answer
from restkv.integration.sweeps import prefill_caches
from helpers import CACHE, prompt, tiny_model

KNOBS = [dict(method="snapkv"), dict(method="adakv", floor=0.0), dict(method="restkv", gqa_agg="none"),
         dict(method="restkv", decode_interval=3), dict(method="fullkv")]


def budget(knobs):
    return knobs if knobs["method"] == "fullkv" else dict(max_capacity_prompt=24, window_size=6, **knobs)


def padded_context():
    """Two contexts of 60 and 52 tokens, left padded, and their mask."""
    ids = torch.cat([prompt(60, seed=1), prompt(60, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    return ids.masked_fill(mask == 0, 0), mask


def ask(model, cache, context, mask, question, n=8):
    ids = torch.cat([context, question], 1)
    out = model.generate(ids, attention_mask=torch.cat([mask, torch.ones_like(question)], 1), **{CACHE(model): cache},
                         max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("knobs", KNOBS)
def test_answering_a_then_b_equals_b_alone(family, knobs):
    model = tiny_model(family, "sdpa")
    context, mask = padded_context()
    qa, qb = prompt(5, batch=2, seed=7), prompt(9, batch=2, seed=8)
    cache = restkv.compress_context(model, context, mask, **budget(knobs))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.context_layers]
    alone = ask(model, restkv.compress_context(model, context, mask, **budget(knobs)), context, mask, qb)
    first_a = ask(model, cache, context, mask, qa)
    assert torch.equal(ask(model, cache, context, mask, qb), alone)
    assert torch.equal(ask(model, cache, context, mask, qa), first_a)
    for layer, (k, v) in zip(cache.context_layers, before):  # the compressed context is never written
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert cache.rewind().get_seq_length() == cache.context_length == 60


@pytest.mark.parametrize("knobs", KNOBS)
def test_the_whole_prompt_compressed_equals_the_one_shot_path(knobs):
    model = tiny_model("llama", "sdpa")
    ids = torch.cat([prompt(70, seed=3), prompt(70, seed=4)])
    restkv.configure(model, **budget(knobs))
    one_shot = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    kept = restkv.kept_positions(model)
    restkv.detach(model)
    cache = restkv.compress_context(model, ids, **budget(knobs))
    first = cache.logits.argmax(-1, keepdim=True)  # the question-aware path: the question was in the context
    rest = ask(model, cache, ids, torch.ones_like(ids), first, n=7)
    assert torch.equal(torch.cat([first, rest], 1), one_shot)
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(cache.kept, kept))


def test_positions_continue_from_the_full_context_length():
    model = tiny_model("llama", "sdpa")
    context, mask = padded_context()
    question = prompt(6, batch=2, seed=9)
    cache = restkv.compress_context(model, context, mask, method="fullkv")  # keeps everything: plain decoding
    full = torch.cat([context, question], 1)
    plain = model.generate(full, attention_mask=torch.cat([mask, torch.ones_like(question)], 1), max_new_tokens=8,
                           do_sample=False, pad_token_id=0)[:, full.shape[1]:]
    assert torch.equal(ask(model, cache, context, mask, question), plain)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_context_prefill_for_every_config_equals_compressing_each(family):
    model = tiny_model(family, "eager")
    context, mask = padded_context()
    question = prompt(7, batch=2, seed=5)
    configs = [budget(k) for k in KNOBS]
    pre = prefill_caches(model, context, mask, configs)
    for cfg, cache, kept in zip(configs, pre.caches, pre.kept):
        swept = answer(model, ContextCache(cache, pre.logits, kept), question, mask, 8, pad_token_id=0)
        assert torch.equal(swept, ask(model, restkv.compress_context(model, context, mask, **cfg), context, mask,
                                      question)), cfg


def test_the_model_reads_the_cache_under_any_attachment():
    model = tiny_model("llama", "sdpa")
    context, question = prompt(60), prompt(5, seed=6)
    cache = restkv.compress_context(model, context, method="snapkv", max_capacity_prompt=24, window_size=6)
    assert model._restkv.cfg.method == "fullkv"  # attached so that decoding reads the compressed layers
    expected = ask(model, cache, context, torch.ones_like(context), question)
    restkv.configure(model, method="h2o", max_capacity_prompt=16, window_size=4)  # another config stays
    assert torch.equal(ask(model, cache, context, torch.ones_like(context), question), expected)
    assert model._restkv.cfg.method == "h2o"


def test_bad_input_raises_before_any_work():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ValueError, match="context_ids must be"):
        restkv.compress_context(model, torch.arange(10))
    with pytest.raises(ValueError, match="attention_mask must match"):
        restkv.compress_context(model, prompt(10), torch.ones(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="window_size"):
        restkv.compress_context(model, prompt(10), method="snapkv", max_capacity_prompt=8, window_size=8)
    assert getattr(model, "_restkv", None) is None


def test_an_input_not_beginning_with_the_context_is_refused_in_one_line_before_any_forward():
    model = tiny_model("llama", "sdpa")
    context, question = prompt(60, seed=1), prompt(5, seed=7)
    cache = restkv.compress_context(model, context, method="snapkv", max_capacity_prompt=24, window_size=6)
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    other = prompt(60, seed=2)
    other[0, 0] = (context[0, 0] + 1) % 64  # another document of the same length, from its first token
    for ids, got in ((torch.cat([other, question], 1), "got 65 tokens whose first 60 are another context"),
                     (question, "got 5 tokens"), (context, "got 60 tokens")):
        with pytest.raises(ValueError, match="begins with the 60-token context it was compressed from") as err:
            model.generate(ids, **{CACHE(model): cache}, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert str(err.value).endswith(got) and "\n" not in str(err.value)
    assert not forwards
    ask(model, cache, context, torch.ones_like(context), question)  # the context then a question still answers
    assert forwards
