"""No host sync per decoded token: restkv adds no .item()/.tolist()/bool()/int() to a decoding step of an
evicted cache (dense or packed per head), sweep mode's greedy decoding reads the host once every
CHECK_EVERY tokens, and no RoPE is captured for a decoded token.

Counted: calls of the Python-level conversions of torch.Tensor (the syncs Python code makes); syncs inside
torch operators (boolean-mask indexing, nonzero) are not seen here."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import prompt, tiny_model
from transformers.cache_utils import DynamicCache

import restkv
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
