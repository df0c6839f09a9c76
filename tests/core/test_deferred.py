"""Selections finished after the prefill (``restkv.eviction.deferred``): the cross-layer budget and KVzip.

Each against a reference written from its definition (float64 loops over entries a plain forward of the
model gives, no restkv code); decoding on the result equals the masked full cache; the passes leave
nothing in the cache; sweep mode equals configure + generate; the attachment leaves no hook behind.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

import restkv
from restkv.strategies.budgets import global_sizes
from restkv.config import CompressionConfig
from helpers import capture, generate, masked_reference_logits, prompt, small, tiny_model, tiny_tokenizer

LAYERS, HKV, G = 3, 2, 3  # the tiny models: 3 layers, 2 KV heads of 3 query heads each


@pytest.mark.parametrize("seed", range(3))
def test_global_sizes_count_the_top_entries_of_a_sorted_list(seed):
    g = torch.Generator().manual_seed(seed)
    scores = [torch.rand(2, 3, 17, generator=g) ** (1 + 4 * layer) for layer in range(4)]  # layers on other scales
    for s in scores:
        s[1, :, :12] = float("-inf")  # sample 1 is short: 4 layers x 3 heads x 5 real entries
    sizes = global_sizes(scores, 40)
    for b, total in ((0, 40), (1, 60)):
        entries = sorted(((float(scores[l][b, h, p]), l, h) for l in range(4) for h in range(3) for p in range(17)),
                         reverse=True)
        counts: dict = {}
        for value, l, h in entries[:40]:
            if not math.isinf(value):
                counts[l, h] = counts.get((l, h), 0) + 1
        assert sum(counts.values()) == min(40, total)  # the short sample keeps its real entries, never padding
        for l in range(4):
            for h in range(3):
                assert int(sizes[l][b, h]) == counts.get((l, h), 0)


def repeat_ids(tok, ids, i: int, start: int, stop: int) -> list:
    """KVzip's i-th repeat pass over ``ids[0, start:stop]``: the request, the 8 tokens before the chunk
    after the first pass, a newline, the chunk."""
    ask = ("\n\nRepeat the previous context exactly." if i == 0 else
           "\n\nRepeat the part of the previous context exactly, starting with ")
    repeat = tok.encode(ask, add_special_tokens=False) + (ids[0, start - 8 : start].tolist() if i else [])
    return repeat + tok.encode("\n", add_special_tokens=False) + ids[0, start:stop].tolist()


def assert_global_top(kept, reference, window, total):
    """``kept`` (restkv.kept_positions) is the window plus the top ``total`` of ``reference`` [layers, Hkv, P]
    over all layers and heads (entries within 1e-5 of the cut may fall either side)."""
    P = reference.shape[-1]
    cut = reference.flatten().sort(descending=True).values[total - 1]
    count = 0
    for layer, positions in enumerate(kept):
        for h in range(HKV):
            own = {int(p) for p in positions[0, h] if p >= 0}
            assert set(range(P, P + window)) <= own
            prefix = own - set(range(P, P + window))
            count += len(prefix)
            for p in range(P):
                value = float(reference[layer, h, p])
                assert (value >= cut - 1e-5) if p in prefix else (value <= cut + 1e-5), (layer, h, p)
    assert count == total


def test_global_budget_keeps_the_top_snapkv_scores_of_all_layers():
    model = tiny_model("llama", "eager")
    ids, budget, window = prompt(64), 20, 6
    restkv.configure(model, method="snapkv", pooling="none", layer_budget="global", max_capacity_prompt=budget,
                     window_size=window)
    model(ids, use_cache=True)
    kept = restkv.kept_positions(model)
    n, P = ids.shape[1], ids.shape[1] - window
    reference = torch.zeros(LAYERS, HKV, P, dtype=torch.float64)
    for layer, (q, k, scaling) in capture(model, ids).items():
        for qh in range(HKV * G):
            for t in range(P, n):
                a = torch.softmax(q[0, qh, t] @ k[0, qh // G, : t + 1].T * scaling, -1)
                reference[layer, qh // G] += a[:P] / G  # summed over the window, mean over the group
    assert len({int((k >= 0).sum()) for k in kept}) > 1, "layers keep different numbers of entries"
    assert_global_top(kept, reference, window, LAYERS * HKV * (budget - window))


def test_kvzip_keeps_what_a_float64_reconstruction_scores_highest():
    model = tiny_model("llama", "eager")
    ids, budget, window, sinks, chunk = prompt(70), 24, 4, 4, 24
    restkv.configure(model, **small("kvzip", max_capacity_prompt=budget, window_size=window))
    model(ids, use_cache=True)  # a plain call finishes the selection too
    kept = restkv.kept_positions(model)
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer())
    n, P = ids.shape[1], ids.shape[1] - window
    reference = torch.zeros(LAYERS, HKV, n, dtype=torch.float64)
    for i, start in enumerate(range(sinks, n, chunk)):
        stop = min(n, start + chunk)
        repeat = repeat_ids(tok, ids, i, start, stop)
        for layer, (q, k, scaling) in capture(model, torch.cat([ids, torch.tensor([repeat])], 1)).items():
            seen = torch.cat([k[:, :, :sinks], k[:, :, start:stop], k[:, :, n:]], 2)[0]  # [Hkv, s + c + r, d]
            for qh in range(HKV * G):
                for t in range(len(repeat)):
                    logits = q[0, qh, n + t] @ seen[qh // G].T * scaling
                    logits[sinks + stop - start + t + 1 :] = float("-inf")  # causal among the repeat's tokens
                    a = torch.softmax(logits, -1)[sinks : sinks + stop - start]
                    row = reference[layer, qh // G, start:stop]
                    torch.maximum(row, a, out=row)  # max over the repeat's queries and the group
    reference[..., :sinks] = 2.0  # the sinks are always kept
    assert_global_top(kept, reference[..., :P], window, LAYERS * HKV * (budget - window))


def _layer_types(model, ids, sizes):
    """Pre-hook on the decoder recording (input length, cache layer types) of each forward."""
    def hook(module, args, kwargs):
        cache = kwargs.get("cache")
        sizes.append((kwargs["input_ids"].shape[1], tuple(type(l).__name__ for l in cache.layers) if cache else ()))
    return model.model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("knobs", [
    dict(method="kvzip"),
    dict(method="kvzip", layer_budget="uniform", head_budget="adakv", floor=0.0),  # kvpress's layerwise=True
    dict(method="kvzip", max_capacity_prompt_ratio=0.4),
    dict(method="snapkv", layer_budget="global"),
    dict(method="restkv", layer_budget="global"),
], ids=["kvzip", "kvzip-layerwise", "kvzip-ratio", "snapkv-global", "restkv-global"])
def test_deferred_decoding_equals_masked_full_cache(family, knobs):
    knobs = dict(knobs)
    method = knobs.pop("method")
    model = tiny_model(family, "eager")
    ids = torch.cat([prompt(70, seed=1), prompt(70, seed=2)])  # two samples: one set of passes each
    sizes: list = []
    budget = {} if "max_capacity_prompt_ratio" in knobs else dict(max_capacity_prompt=24)
    restkv.configure(model, **small(method, window_size=6, **budget, **knobs))
    hook = _layer_types(model, ids, sizes)
    _, logits = generate(model, ids, n=5)
    hook.remove()
    assert sizes[0][0] == 70 and all(length == 1 for length, _ in sizes[-4:])
    passes = [length for length, _ in sizes[1:-4]]
    assert len(passes) == (2 * math.ceil(66 / 24) if method == "kvzip" else 0)
    assert all("DynamicLayer" not in types for _, types in sizes[-4:])  # compressed before the first new token
    kept = restkv.kept_positions(model)
    torch.testing.assert_close(logits, masked_reference_logits(model, ids, kept, 5), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_passes_leave_nothing_in_the_cache(family):
    model = tiny_model(family, "sdpa")
    ids = prompt(60)
    full = model(ids, use_cache=True).past_key_values
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    with restkv.compressing(model, **small("kvzip", max_capacity_prompt=20, window_size=4)):
        out = model.model(input_ids=ids, use_cache=True)  # the decoder alone finishes the selection too
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        kept = restkv.kept_positions(model)
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks
    for i, (layer, plain) in enumerate(zip(cache.layers, full.layers)):
        assert layer.get_seq_length() == 60
        if kept[i] is None:  # sliding-window layer: exactly the plain prefill's
            assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values)
        else:
            assert layer.keys.shape[0] == int((kept[i] >= 0).sum())  # the kept entries, packed


def _separate(model, ids, mask, cfg):
    restkv.configure(model, **cfg)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:], restkv.kept_positions(model)


@pytest.mark.parametrize("padded", [False, True], ids=["batch1", "padded2"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sweep_equals_configure_and_generate_with_one_set_of_passes(family, padded):
    model = tiny_model(family, "sdpa")
    ids = torch.cat([prompt(64, seed=3), prompt(64, seed=4)])
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :20], mask[1, :20] = 0, 0
    configs = [small("kvzip", max_capacity_prompt=20, window_size=4),
               small("kvzip", max_capacity_prompt=28, window_size=4),
               small("kvzip", max_capacity_prompt=20, window_size=4, layer_budget="uniform"),
               dict(method="snapkv", layer_budget="global", max_capacity_prompt=20, window_size=4),
               dict(method="snapkv", layer_budget="global", max_capacity_prompt_ratio=0.3, window_size=4),
               dict(method="snapkv", max_capacity_prompt=20, window_size=4)]
    lengths: list = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)
    swept = restkv.sweep(model, ids, mask, configs, 4, pad_token_id=0)
    hook.remove()
    real = [64, 44 if padded else 64]
    assert len([n for n in lengths if n > 1]) == 1 + sum(math.ceil((r - 4) / 24) for r in real)
    for cfg, (tokens, kept) in zip(configs, swept):
        ref_tokens, ref_kept = _separate(model, ids, mask, cfg)
        assert torch.equal(tokens, ref_tokens), cfg
        for k, r in zip(kept, ref_kept):
            assert (k is None) == (r is None) and (k is None or torch.equal(k, r)), cfg


def test_kvzip_needs_a_tokenizer_and_global_budgets_refuse_what_they_cannot_share():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="tokenizer"):
        restkv.configure(model, method="kvzip", max_capacity_prompt=20, window_size=4)
    assert not any(hasattr(m, "_restkv") for m in model.modules())
    assert CompressionConfig(method="snapkv", use_pyramid=True).layer_budget == "pyramid"  # the original's flag
    assert CompressionConfig(method="pyramidkv").pyramid and not CompressionConfig(method="kvzip").pyramid
    with pytest.raises(ValueError, match="head_budget is read by method snapkv only when layer_budget is"):
        CompressionConfig(method="snapkv", layer_budget="global", head_budget="adakv")
    for bad in (dict(gqa_agg="none"), dict(merge="pivot")):
        with pytest.raises(ValueError, match="layer_budget='global' needs"):
            CompressionConfig(method="snapkv", layer_budget="global", **bad)


@pytest.mark.slow
def test_kvzip_passes_follow_the_chat_template_of_smollm2():
    from types import SimpleNamespace

    from restkv.bench.models import resolve
    from restkv.methods import kvzip

    path = resolve("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor(tok.encode("The river Quell runs past old mills. " * 40, add_special_tokens=False))
    cfg = CompressionConfig(method="kvzip", repeat_chunk=100, max_capacity_prompt=64, window_size=8).score_knobs()
    sinks, passes = kvzip.passes(ids, cfg, SimpleNamespace(config=SimpleNamespace(name_or_path=path)))
    assert sinks == 4 and [p[:2] for p in passes] == [(s, min(len(ids), s + 100)) for s in range(4, len(ids), 100)]
    for i, (start, stop, pass_ids) in enumerate(passes):
        ask = ("\n\nRepeat the previous context exactly." if i == 0 else
               "\n\nRepeat the part of the previous context exactly, starting with " + tok.decode(ids[start - 8 : start]))
        assert tok.decode(pass_ids) == ask + "<|im_end|>\n<|im_start|>assistant\n" + tok.decode(ids[start:stop])


def test_a_context_compressed_once_runs_the_passes_as_configure_does():
    model = tiny_model("llama", "sdpa")
    ids = prompt(64)
    knobs = small("kvzip", max_capacity_prompt=20, window_size=4)
    cache = restkv.compress_context(model, ids, **knobs)
    restkv.configure(model, **knobs)
    model(ids, use_cache=True)
    assert all(torch.equal(a, b) for a, b in zip(cache.kept, restkv.kept_positions(model)))
    held = [layer.keys.clone() for layer in cache.context_layers]
    question = prompt(5, seed=9)
    out = model.generate(torch.cat([ids, question], 1), past_key_values=cache, max_new_tokens=3, do_sample=False,
                         pad_token_id=0, attention_mask=torch.ones(1, 69, dtype=torch.long))
    assert out.shape[1] == 72 and all(torch.equal(k, layer.keys) for k, layer in zip(held, cache.context_layers))
