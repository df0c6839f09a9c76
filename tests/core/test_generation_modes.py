"""``generate()``'s decoding modes on an evicted cache: assisted decoding gives greedy's tokens (its rejected
candidates cropped), beam search on the packed per-head layout gives the dense layout's tokens, sampling with
``num_return_sequences`` gives the repeated batch's, and what cannot run is refused before any forward."""

from __future__ import annotations

import pytest
import torch
from helpers import cache_of, prompt, tiny_model

import restkv
from restkv.cache import KeptLayer, VarlenLayer

BUDGET = dict(max_capacity_prompt=20, window_size=4)


def greedy(model, ids, mask=None, n=16, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:]


@pytest.fixture
def crops(monkeypatch):
    """How many entries each ``crop`` removed, on the kept and packed layers."""
    removed = []
    for cls in (KeptLayer, VarlenLayer):
        original = cls.crop

        def spy(self, tokens, original=original):
            removed.append(-tokens)
            return original(self, tokens)

        monkeypatch.setattr(cls, "crop", spy)
    return removed


@pytest.mark.parametrize("knobs", [dict(method="snapkv"), dict(method="restkv"), dict(method="adakv"),
                                   dict(method="restkv", gqa_agg="none"), dict(method="snapkv", pruning_ratio=0.5),
                                   dict(method="fullkv")])
def test_assisted_decoding_gives_greedy_tokens(knobs, crops):
    model = tiny_model("llama")
    ids = torch.cat([prompt(30, seed=3)] * 2, 1)  # a repeated prompt: prompt lookup finds candidates
    knobs = knobs if knobs["method"] == "fullkv" else dict(BUDGET, **knobs)
    restkv.configure(model, **knobs)
    expected = greedy(model, ids, n=24)
    kept = restkv.kept_positions(model)
    assert torch.equal(greedy(model, ids, n=24, prompt_lookup_num_tokens=3), expected)
    assert all(a is None or torch.equal(a, b) for a, b in zip(restkv.kept_positions(model), kept))
    if knobs["method"] != "fullkv":
        assert any(r > 0 for r in crops)  # rejected candidates were removed from the evicted cache


def test_assisted_decoding_on_flash(crops):
    from flash_reference import flash_model, reference_flash

    ids = torch.cat([prompt(30, seed=3)] * 2, 1)
    with reference_flash():
        model = flash_model("llama")
        restkv.configure(model, method="adakv", **BUDGET)
        assert torch.equal(greedy(model, ids, n=24, prompt_lookup_num_tokens=3), greedy(model, ids, n=24))


@pytest.mark.parametrize("knobs,knob", [(dict(method="snapkv", decode_interval=4), "decode_interval"),
                                        (dict(method="restkv", layer_budget="global"), "layer_budget")])
def test_assisted_decoding_refused_before_any_forward(knobs, knob):
    model = tiny_model("llama")
    restkv.configure(model, **BUDGET, **knobs)
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=knob):
        greedy(model, prompt(40), prompt_lookup_num_tokens=3)
    assert not calls


@pytest.mark.parametrize("main_evicts", [True, False])
def test_an_evicted_assistant_is_refused_before_any_forward(main_evicts):
    """A draft model with restkv attached: refused at its first generate(), before either model's forward;
    detached, it drafts for the evicted main model and the tokens are greedy's."""
    model, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids = torch.cat([prompt(30, seed=3)] * 2, 1)
    restkv.configure(model, method="snapkv" if main_evicts else "fullkv", **BUDGET)
    restkv.configure(draft, method="snapkv", **BUDGET)
    calls = []
    for m in (model, draft):
        m.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="assistant_model"):
        greedy(model, ids, n=12, assistant_model=draft)
    assert not calls
    restkv.detach(draft)
    assert torch.equal(greedy(model, ids, n=12, assistant_model=draft), greedy(model, ids, n=12))


@pytest.mark.parametrize("knobs", [dict(method="adakv"), dict(method="adakv", max_capacity_prompt_ratio=0.4)])
def test_beam_search_on_the_packed_layout_equals_the_dense_layout(knobs):
    model = tiny_model("llama")
    ids = torch.cat([prompt(60, seed=1), prompt(60, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    budget = {} if "max_capacity_prompt_ratio" in knobs else dict(max_capacity_prompt=20)
    results = []
    for varlen in (True, False):
        restkv.configure(model, window_size=4, varlen=varlen, **budget, **knobs)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, num_beams=3, num_return_sequences=2,
                             do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        layer_types = {type(layer) for layer in cache_of(out).layers}
        results.append((out.sequences[:, ids.shape[1]:], out.sequences_scores, layer_types))
    assert any(issubclass(t, VarlenLayer) for t in results[0][2])
    assert not any(issubclass(t, VarlenLayer) for t in results[1][2])
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)


def test_packed_reorder_gathers_each_samples_segments():
    """Reordering a packed layer equals packing the reordered samples: entries, positions and appended steps."""
    from restkv.cache import Kept

    g = torch.Generator().manual_seed(0)
    b, heads, width, d = 3, 2, 7, 4
    lengths = torch.tensor([[7, 3], [5, 6], [2, 4]])
    valid = torch.arange(width) < lengths[..., None]
    keys, values = torch.randn(b, heads, width, d, generator=g), torch.randn(b, heads, width, d, generator=g)
    positions = torch.arange(width).expand(b, heads, width).masked_fill(~valid, -1)
    layer = VarlenLayer(Kept(keys, values, positions, valid, per_head=True), seen=10)
    steps = [torch.randn(b, heads, 1, d, generator=g) for _ in range(3)]
    for k in steps:
        layer.update(k, -k)
    order = torch.tensor([2, 0, 0, 1])
    layer.reorder_cache(order)
    ref = VarlenLayer(Kept(keys[order], values[order], positions[order], valid[order], per_head=True), seen=10)
    for k in steps:
        ref.update(k[order], -k[order])
    for got, want in zip(layer.stored_entries(), ref.stored_entries()):
        assert torch.equal(got, want)
    query = torch.randn(4, heads * 3, 1, d, generator=g)
    new = torch.randn(4, heads, 1, d, generator=g)
    layer.update(new, new)
    ref.update(new, new)
    torch.testing.assert_close(layer.attend(query, 0.5), ref.attend(query, 0.5))


def test_sampling_with_num_return_sequences_equals_the_repeated_batch():
    model = tiny_model("llama")
    ids = prompt(60)
    restkv.configure(model, method="adakv", **BUDGET)
    torch.manual_seed(5)
    sampled = model.generate(ids, max_new_tokens=8, do_sample=True, num_return_sequences=3, pad_token_id=0)
    kept = restkv.kept_positions(model)
    torch.manual_seed(5)
    repeated = model.generate(ids.repeat(3, 1), max_new_tokens=8, do_sample=True, pad_token_id=0)
    assert torch.equal(sampled, repeated)
    assert all(k.shape[0] == 3 and torch.equal(k[0], k[2]) for k in kept)
    assert not torch.equal(sampled[0], sampled[1]) or not torch.equal(sampled[1], sampled[2])  # really sampled


@pytest.mark.parametrize("packed", [False, True])
def test_crop_removes_the_decoded_tail_only(packed):
    """A cropped layer holds what one that never saw the removed tokens holds; the kept prompt stays."""
    from restkv.cache import CompressedLayer, Kept

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 6, 4, generator=g), torch.randn(2, 2, 6, 4, generator=g)
    valid = torch.ones(2, 2, 6, dtype=torch.bool)
    valid[1, 0, :2] = False
    kept = Kept(keys, values, torch.arange(6).expand(2, 2, 6).masked_fill(~valid, -1), valid, per_head=True)

    def layer():
        return VarlenLayer(kept, seen=40) if packed else CompressedLayer(kept, seen=40, room=3)

    steps = [torch.randn(2, 2, 1, 4, generator=g) for _ in range(5)]
    cropped, ref = layer(), layer()
    for k in steps[:4]:
        cropped.update(k, -k)
    cropped.crop(-3)  # transformers' convention: a negative count
    cropped.update(steps[4], -steps[4])
    for k in (steps[0], steps[4]):
        ref.update(k, -k)
    assert cropped.get_seq_length() == ref.get_seq_length() == 42
    for got, want in zip(cropped.stored_entries(), ref.stored_entries()):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="crop"):
        cropped.crop(-3)  # only 2 decoded entries: the kept prompt cannot go


def test_packed_reorders_crops_and_selections_compose():
    """Reordering twice (rows remapped, nothing copied), cropping the decoded tail, appending again and
    then keeping fewer samples (rows gathered) equal the same steps on the reordered samples packed anew."""
    from restkv.cache import Kept

    g = torch.Generator().manual_seed(1)
    b, heads, width, d = 3, 2, 6, 4
    lengths = torch.tensor([[6, 2], [4, 5], [1, 3]])
    valid = torch.arange(width) < lengths[..., None]
    keys, values = torch.randn(b, heads, width, d, generator=g), torch.randn(b, heads, width, d, generator=g)
    positions = torch.arange(width).expand(b, heads, width).masked_fill(~valid, -1)
    layer = VarlenLayer(Kept(keys, values, positions, valid, per_head=True), seen=10)
    steps = [torch.randn(b, heads, 1, d, generator=g) for _ in range(5)]
    first, second = torch.tensor([2, 0, 0]), torch.tensor([1, 1, 2])
    for k in steps[:2]:
        layer.update(k, -k)
    layer.reorder_cache(first)
    layer.update(steps[2], -steps[2])
    layer.reorder_cache(second)
    layer.crop(-1)  # the step appended after the first reorder
    for k in steps[3:]:
        layer.update(k, -k)
    order = first[second]
    ref = VarlenLayer(Kept(keys[order], values[order], positions[order], valid[order], per_head=True), seen=10)
    for k in steps[:2]:
        ref.update(k[order], -k[order])
    for k in steps[3:]:
        ref.update(k, -k)
    for got, want in zip(layer.stored_entries(), ref.stored_entries()):
        assert torch.equal(got, want)
    fewer = torch.tensor([2, 0])
    layer.reorder_cache(fewer)
    ref.reorder_cache(fewer)
    for got, want in zip(layer.stored_entries(), ref.stored_entries()):
        assert torch.equal(got, want)
    query = torch.randn(2, heads * 3, 1, d, generator=g)
    new = torch.randn(2, heads, 1, d, generator=g)
    layer.update(new, new)
    ref.update(new, new)
    torch.testing.assert_close(layer.attend(query, 0.5), ref.attend(query, 0.5))
