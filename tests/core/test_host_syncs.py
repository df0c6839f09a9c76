"""No host sync per decoded token: restkv adds no .item()/.tolist()/bool()/int() to a decoding step of an
evicted cache (dense or packed per head), sweep mode's greedy decoding reads the host once every
CHECK_EVERY tokens, eviction while decoding reads it once per interval for the whole model, beam search
reorders the packed layout with no read, and no RoPE is captured or computed for a decoded token unless
a scorer reads it.

Counted: calls of the Python-level conversions of torch.Tensor (the syncs Python code makes); syncs inside
torch operators (boolean-mask indexing, nonzero) are not seen here."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import prompt, small, tiny_model
from transformers.cache_utils import DynamicCache

import restkv
from restkv.cache import CompressedLayer, VarlenLayer
from restkv.eviction.plans import attention_modules as attachment_modules
from restkv.integration import attachment, generation

CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def counting_syncs():
    """Counts the tensor-to-host conversions in the block: ``with counting_syncs() as n: ...; n[0]``."""
    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def counted(original):
        def call(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def decode_syncs(model, ids, steps=6):
    """Host conversions during ``steps`` decoding forwards after a prefill (none during the prefill counted)."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, cache=DynamicCache(), logits_to_keep=1)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        with counting_syncs() as n:
            for i in range(steps):
                pos = torch.full_like(tok, ids.shape[1] + i)
                logits = model(
                    input_ids=tok, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1
                ).logits
                tok = logits[:, -1].argmax(-1, keepdim=True)
    return n[0]


@pytest.mark.parametrize("method", ["restkv", "snapkv", "adakv"])
def test_decoding_an_evicted_cache_adds_no_host_sync(method, monkeypatch):
    model, ids = tiny_model(), prompt(90)
    restkv.configure(model, method="fullkv")
    baseline = decode_syncs(model, ids)
    captured = []
    monkeypatch.setattr(attachment, "capture", lambda *a: captured.append(a) or None)
    restkv.configure(model, method=method, max_capacity_prompt=40)
    assert decode_syncs(model, ids) == baseline
    assert (
        len(captured) == model.config.num_hidden_layers
    )  # the prefill's only: no RoPE per decoded token
    restkv.detach(model)


def test_greedy_decode_reads_the_host_once_every_check(monkeypatch):
    model, ids = tiny_model(), prompt(60)
    restkv.configure(model, method="fullkv")
    steps = 40
    baseline = decode_syncs(
        model, ids, steps - 1
    )  # the model's own conversions over the same forwards
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, cache=DynamicCache(), logits_to_keep=1)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        first = out.logits[:, -1].argmax(-1)
        never = torch.tensor([1000])  # an EOS id outside the vocabulary: no row finishes
        with counting_syncs() as n:
            tokens, length = generation.greedy_decode(
                model, cache, first, torch.arange(60)[None], None, steps, never, 0
            )
    assert n[0] - baseline == 2  # at token 32 and at the last (40): not once per token
    assert tokens.shape == (1, steps) and int(length) == steps
    restkv.detach(model)


def test_greedy_decode_stops_and_trims_as_before():
    model, ids = tiny_model(), prompt(60)
    restkv.configure(model, method="fullkv")
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, cache=DynamicCache(), logits_to_keep=1)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        first = out.logits[:, -1].argmax(-1)
        free, _ = generation.greedy_decode(
            model, cache, first, torch.arange(60)[None], None, 12, torch.tensor([1000]), 0
        )
    eos = free[
        0, 4:5
    ]  # the 5th token as EOS: decoding ends there, trimmed to 5 tokens (or earlier if it repeats)
    stop = int((free[0] == eos).nonzero()[0]) + 1
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, cache=DynamicCache(), logits_to_keep=1)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        tokens, length = generation.greedy_decode(
            model, cache, first, torch.arange(60)[None], None, 12, eos, 0
        )
    assert torch.equal(tokens, free[:, :stop]) and int(length) == stop
    restkv.detach(model)


def syncs_per_token(model, ids, steps, mask=None, reorder=None):
    """Host conversions of each of ``steps`` decoding forwards after a prefill of ``ids`` (with ``mask``),
    and the cache; ``reorder(step)`` [b] (beam search) reorders the cache before each forward."""
    mask = torch.ones_like(ids) if mask is None else mask
    counts = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, cache=DynamicCache())
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(steps):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            with counting_syncs() as n:
                if reorder is not None:
                    cache.reorder_cache(reorder(step))
                out = model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True)
            counts.append(n[0])
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return counts, cache


INTERVAL = 4
EVERY_INTERVAL = [  # (knobs, per-head layout): dense, packed per head, dense per head, per-sample budgets
    (dict(method="snapkv"), None),
    (dict(method="restkv"), None),
    (dict(method="adakv"), VarlenLayer),
    (dict(method="adakv", varlen=False), CompressedLayer),
    (dict(method="restkv", head_budget="adakv", gqa_agg="none", floor=0.0), VarlenLayer),
    (dict(method="adakv", max_capacity_prompt_ratio=0.5), VarlenLayer),
    (dict(method="restkv", scale=4.0), None),  # adaptive pooling wider than its kernel
    (small("lacache"), None),  # its ladder from each sample's length
    (dict(method="snapkv", decode_compression_ratio=0.5), None),  # budgets from the tokens seen
    (dict(method="adakv", decode_compression_ratio=0.5), VarlenLayer),
]


@pytest.mark.parametrize("knobs,layout", EVERY_INTERVAL)
def test_eviction_while_decoding_reads_the_host_once_per_interval(knobs, layout):
    """Every layer evicts again at each interval; the whole model reads the host once then, never between."""
    model = tiny_model("llama", "eager", seed=3)
    ids = torch.cat([prompt(50, seed=1), prompt(50, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a left-padded sample: with a ratio, a budget of its own
    steps = 3 * INTERVAL
    restkv.configure(model, method="fullkv")
    baseline, _ = syncs_per_token(model, ids, steps, mask)
    budget = {} if "max_capacity_prompt_ratio" in knobs else dict(max_capacity_prompt=24)
    restkv.configure(model, window_size=6, decode_interval=INTERVAL, **budget, **knobs)
    counts, cache = syncs_per_token(model, ids, steps, mask)
    extra = [n - b for n, b in zip(counts, baseline)]
    due = [(i + 1) % INTERVAL == 0 for i in range(steps)]
    assert extra == [1 if d else 0 for d in due], extra
    layers = cache.layers
    assert all(layer.since == 0 and layer.policy is not None for layer in layers)  # all evicted last token
    held = torch.stack([layer.stored_entries()[2].sum(-1).amax() for layer in layers])
    assert int(held.max()) <= 50  # back to the budget (24, or half a 50-token prompt) plus the window
    if layout is not None:
        assert all(type(layer) is layout for layer in layers)
    restkv.detach(model)


@pytest.mark.parametrize("knobs", [small("lacache"), small("lacache", sink_tokens=4)])
def test_lacache_prefill_reads_the_host_as_snapkv_does(knobs):
    """LaCache's ladder, from each sample's length, adds no host read to the prefill: once per layer
    (its cache layer's sizes), as SnapKV's."""
    model = tiny_model("llama", "eager", seed=3)
    ids = torch.cat([prompt(50, seed=1), prompt(50, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    counts = []
    for method in (dict(method="snapkv"), knobs):
        restkv.configure(model, max_capacity_prompt=24, window_size=6, **method)
        with torch.no_grad(), counting_syncs() as n:
            model(input_ids=ids, attention_mask=mask, use_cache=True, cache=DynamicCache())
        counts.append(n[0])
    assert counts == [model.config.num_hidden_layers] * 2, counts
    restkv.detach(model)


def test_beam_search_on_the_packed_layout_reads_no_host():
    """Reordering the packed per-head layout every step (beam search) adds no host read."""
    model = tiny_model("llama", seed=2)
    ids = prompt(60).repeat(3, 1)
    g = torch.Generator().manual_seed(0)
    orders = [torch.randint(0, 3, (3,), generator=g) for _ in range(6)]
    restkv.configure(model, method="fullkv")
    baseline, _ = syncs_per_token(model, ids, 6, reorder=orders.__getitem__)
    restkv.configure(model, method="adakv", max_capacity_prompt=20, window_size=4)
    counts, cache = syncs_per_token(model, ids, 6, reorder=orders.__getitem__)
    assert all(type(layer) is VarlenLayer for layer in cache.layers)
    assert counts == baseline
    restkv.detach(model)


@pytest.mark.parametrize("method,reads", [("snapkv", False), ("expected_attention", True)])
def test_rope_is_computed_while_decoding_only_for_a_scorer_that_reads_it(method, reads):
    """With decode_interval=1 the rotary module runs at each decoded token of each layer only when the
    scorer reads RoPE (Expected Attention), never for SnapKV."""
    model = tiny_model(seed=1)
    ids = prompt(60)
    restkv.configure(model, method=method, max_capacity_prompt=24, window_size=4, decode_interval=1)
    calls = []
    for m in attachment_modules(model):
        embed = m._restkv.embed
        m._restkv.embed = lambda positions, embed=embed: calls.append(1) or embed(positions)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, cache=DynamicCache())
        prefill = len(calls)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    assert all(layer.since == 0 for layer in cache.layers)  # every layer evicted at every token
    assert (len(calls) - prefill >= 3 * model.config.num_hidden_layers) == reads
    assert reads or len(calls) == prefill  # none at all while decoding
    restkv.detach(model)


@pytest.mark.parametrize("varlen", [True, False])
def test_beam_search_with_eviction_while_decoding_reads_the_host_twice_per_interval(varlen):
    """Reordered samples lose their layers' sizes: at the next interval one read measures every layer,
    one puts the shrunk layers in place; none between intervals."""
    model = tiny_model("llama", seed=2)
    ids = torch.cat([prompt(60, seed=1), prompt(60, seed=2)])
    g = torch.Generator().manual_seed(0)
    orders = [torch.randint(0, 2, (2,), generator=g) for _ in range(2 * INTERVAL)]
    restkv.configure(model, method="fullkv")
    baseline, _ = syncs_per_token(model, ids, 2 * INTERVAL, reorder=orders.__getitem__)
    restkv.configure(model, method="adakv", max_capacity_prompt=20, window_size=4, varlen=varlen,
                     decode_interval=INTERVAL)
    counts, cache = syncs_per_token(model, ids, 2 * INTERVAL, reorder=orders.__getitem__)
    extra = [n - b for n, b in zip(counts, baseline)]
    assert extra == [2 if (i + 1) % INTERVAL == 0 else 0 for i in range(2 * INTERVAL)], extra
    assert all(layer.since == 0 for layer in cache.layers)
    restkv.detach(model)
