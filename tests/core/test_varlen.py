"""The variable-length layer's buffer: appends with room, copies that leave the original alone, queries
of several tokens, low precision and softcap, each against attention written out per segment."""

from __future__ import annotations

import copy

import pytest
import torch

from restkv.cache import VarlenLayer
from restkv.eviction.select import Kept
from restkv.cache.packed import SegmentIndex, masked_attention

D, G = 8, 3


def per_segment_reference(query, segments, scaling, softcap=None):
    """query [S, g, q, d]; segments: per segment its keys and values [n_s, d] (the last q the queries' own)."""
    out = torch.empty(query.shape, dtype=torch.float64)
    for s, (k, v) in enumerate(segments):
        n, q = k.shape[0], query.shape[2]
        for i in range(q):
            logits = query[s, :, i].double() @ k[: n - q + i + 1].double().T * scaling
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            out[s, :, i] = logits.softmax(-1) @ v[: n - q + i + 1].double()
    return out


def layer_of(lengths, batch=1, dtype=torch.float32, seed=0):
    """A VarlenLayer holding random entries, ``lengths`` per (sample, head), and those entries per segment."""
    g = torch.Generator().manual_seed(seed)
    heads, width = len(lengths) // batch, max(lengths)
    keys, values = (torch.randn(batch, heads, width, D, generator=g).to(dtype) for _ in range(2))
    valid = (torch.arange(width) < torch.tensor(lengths).view(batch, heads, 1))
    kept = Kept(keys, values, torch.arange(width).expand(batch, heads, width).masked_fill(~valid, -1), valid, True)
    flat = [(keys.view(-1, width, D)[s, :n], values.view(-1, width, D)[s, :n]) for s, n in enumerate(lengths)]
    return VarlenLayer(kept, seen=100), flat


def step(layer, segments, q=1, seed=1):
    """Append q entries per segment (to the layer and the reference), attend, and compare."""
    g = torch.Generator().manual_seed(seed)
    S = len(segments)
    b = layer.shape[0]
    new_k, new_v = (torch.randn(b, S // b, q, D, generator=g).to(layer.keys.dtype) for _ in range(2))
    layer.update(new_k, new_v)
    segments = [(torch.cat([k, new_k.reshape(S, q, D)[s]]), torch.cat([v, new_v.reshape(S, q, D)[s]]))
                for s, (k, v) in enumerate(segments)]
    query = torch.randn(b, S // b * G, q, D, generator=g).to(layer.keys.dtype)
    out = layer.attend(query, 0.4).transpose(1, 2)  # [b, Hq, q, d]
    ref = per_segment_reference(query.reshape(S, G, q, D), segments, 0.4).view(out.shape)
    tol = 1e-5 if layer.keys.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    return segments


@pytest.mark.parametrize("batch,lengths", [(1, [9, 4, 13]), (2, [9, 4, 13, 2, 7, 7])])
def test_appends_across_room_growth_and_several_tokens(batch, lengths):
    layer, segments = layer_of(lengths, batch)
    for t, q in enumerate([3, 1, 1, 2] + [1] * 12):  # a question of 3 tokens, then decoding
        segments = step(layer, segments, q, seed=t)
    assert layer.steps == 19 and torch.equal(layer.lengths, torch.tensor(lengths) + 19)
    assert layer.capacity >= layer.steps and layer.index.room == layer.capacity


def test_a_copy_never_writes_the_original():
    layer, segments = layer_of([9, 4, 13])
    layer.reserve(8)  # room the copy could write into
    snapshot = layer.keys.clone(), layer.values.clone()
    fork = copy.copy(layer)
    step(fork, segments, 2)
    assert torch.equal(layer.keys, snapshot[0]) and torch.equal(layer.values, snapshot[1])
    assert layer.steps == 0 and fork.steps == 2
    step(layer, segments, 1, seed=5)  # the original still decodes as if the copy never ran


def test_low_precision_and_softcap():
    layer, segments = layer_of([9, 4, 13], dtype=torch.bfloat16)
    step(layer, segments)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((2, G, 2, D), (2, 1, 6, D), (2, 1, 6, D)))
    visible = torch.ones(2, 1, 2, 6, dtype=torch.bool)
    visible[..., -1] = torch.tensor([False, True])  # causal within the last two
    ref = per_segment_reference(q, [(k[s, 0], v[s, 0]) for s in range(2)], 0.5, softcap=2.0)
    torch.testing.assert_close(masked_attention(q, k, v, visible, 0.5, softcap=2.0).double(), ref, rtol=1e-5, atol=1e-5)


def test_index_rows_point_at_each_segments_entries():
    index = SegmentIndex(torch.tensor([2, 3]), room=2)
    assert index.packed == 5 and index.width == 3
    assert index.rows.tolist() == [[0, 1, 0, 5, 7], [2, 3, 4, 6, 8]]
    assert index.visible[:, 0, 0].tolist() == [[True, True, False, True, True], [True] * 5]
