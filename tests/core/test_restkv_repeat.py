"""Query-agnostic ReST-KV (``restkv_repeat``): every layer keeps the window and the top entries of a float64
loop of ReST-KV's indicator, each repeat query's own ``A/(1 - A) ||W_O^h (o - v_n)||``, its largest value over
the queries of KVzip's passes and the query heads of a group, the sinks first; the question is never read."""

from __future__ import annotations

import pytest
import torch
from helpers import capture, prompt, small, tiny_model, tiny_tokenizer
from test_deferred import HKV, LAYERS, G, assert_global_top, repeat_ids
from transformers import AutoTokenizer

import restkv
from restkv.config import CompressionConfig


def repeat_reference(model, ids, sinks, chunk):
    """[layers, Hkv, n] float64: the largest ReST-KV indicator of each entry over the repeat passes' queries
    and the group, sinks above all."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer())
    n = ids.shape[1]
    w_o = {i: layer.self_attn.o_proj.weight.detach().double() for i, layer in enumerate(model.model.layers)}
    reference = torch.zeros(LAYERS, HKV, n, dtype=torch.float64)
    for i, start in enumerate(range(sinks, n, chunk)):
        stop = min(n, start + chunk)
        repeat = repeat_ids(tok, ids, i, start, stop)
        c = stop - start
        got = capture(model, torch.cat([ids, torch.tensor([repeat])], 1), values=True)
        for layer, (q, k, v, scaling) in got.items():
            def part(x, start=start, stop=stop):
                return torch.cat([x[:, :, :sinks], x[:, :, start:stop], x[:, :, n:]], 2)[0]

            seen_k, seen_v = part(k), part(v)  # [Hkv, sinks + c + r, d]
            d = seen_v.shape[-1]
            for qh in range(HKV * G):
                best = torch.zeros(sinks + c, dtype=torch.float64)
                W = w_o[layer][:, qh * d : (qh + 1) * d]
                for t in range(len(repeat)):
                    logits = q[0, qh, n + t] @ seen_k[qh // G].T * scaling
                    logits[sinks + c + t + 1 :] = float("-inf")  # causal among the repeat's tokens
                    a = torch.softmax(logits, -1)
                    o = a @ seen_v[qh // G]
                    for m in range(sinks + c):
                        change = a[m] / (1 - a[m]) * (W @ (o - seen_v[qh // G, m])).norm()
                        best[m] = max(best[m], change)
                row = reference[layer, qh // G]
                row[start:stop] = torch.maximum(row[start:stop], best[sinks:])
    reference[..., :sinks] = float("inf")
    return reference


def test_restkv_repeat_keeps_the_top_of_a_float64_loop():
    model = tiny_model("llama", "eager")
    ids = prompt(62)
    budget, window, sinks, chunk = 22, 4, 4, 24
    restkv.configure(model, **small("restkv_repeat", max_capacity_prompt=budget, window_size=window))
    model(ids, use_cache=True)
    kept = restkv.kept_positions(model)
    n = ids.shape[1]
    P = n - window
    reference = repeat_reference(model, ids, sinks, chunk)[..., :P]
    for layer, positions in enumerate(kept):
        for h in range(HKV):
            own = {int(p) for p in positions[0, h] if p >= 0}
            assert set(range(P, n)) <= own
            prefix = sorted(own - set(range(P, n)))
            assert len(prefix) == budget - window
            cut = reference[layer, h].sort(descending=True).values[budget - window - 1]
            assert_split_at(reference[layer, h], set(prefix), cut, (layer, h))


def assert_split_at(row, prefix: set, cut: float, where) -> None:
    """Every entry of ``prefix`` scores at least ``cut`` in ``row`` [P], every other at most (1e-4 relative)."""
    for p in range(row.shape[0]):
        value = float(row[p])
        if p in prefix:
            assert value >= cut * (1 - 1e-4), (*where, p)
        else:
            assert value <= cut * (1 + 1e-4), (*where, p)


def test_restkv_repeat_refuses_adaptive_pooling_and_decoding_eviction():
    with pytest.raises(ValueError, match="pooling='adaptive' is not supported by restkv_repeat"):
        CompressionConfig(method="restkv_repeat", pooling="adaptive")
    with pytest.raises(ValueError, match="decode_interval"):
        CompressionConfig(method="restkv_repeat", decode_interval=4)


def test_restkv_repeat_global_keeps_the_top_of_the_float64_loop_over_all_layers():
    """``layer_budget="global"`` (KVzip's split): one top-k of the same indicator over every layer and head."""
    model = tiny_model("llama", "eager")
    ids = prompt(62)
    budget, window, sinks, chunk = 22, 4, 4, 24
    knobs = small("restkv_repeat", max_capacity_prompt=budget, window_size=window, layer_budget="global")
    restkv.configure(model, **knobs)
    model(ids, use_cache=True)
    kept = restkv.kept_positions(model)
    P = ids.shape[1] - window
    reference = repeat_reference(model, ids, sinks, chunk)[..., :P]
    assert_global_top(kept, reference, window, LAYERS * HKV * (budget - window))
    sizes = {int((positions[0, h] >= 0).sum()) for positions in kept for h in range(HKV)}
    assert len(sizes) > 1, "the heads keep different numbers of entries"
