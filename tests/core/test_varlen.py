"""The variable-length layer's buffer: appends with room, copies that leave the original alone, queries
of several tokens, low precision and softcap, each against attention written out per segment."""

from __future__ import annotations

import copy

import pytest
import torch

from restkv.cache import VarlenLayer
from restkv.eviction.select import Kept
from restkv.cache.packed import SegmentIndex, heads_as_queries, masked_attention

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


@pytest.mark.parametrize("q,softcap", [(1, None), (3, None), (1, 2.0), (2, 2.0)])
def test_heads_as_queries_attend_as_grouped_heads(q, softcap):
    """CUDA's layout (a segment's query heads as queries of one head) equals the grouped heads' attention."""
    g = torch.Generator().manual_seed(q)
    query, k, v = (torch.randn(*shape, generator=g) for shape in ((4, G, q, D), (4, 1, 9, D), (4, 1, 9, D)))
    visible = torch.rand(4, 1, q, 9, generator=g) > 0.4
    visible[..., -1] = True
    mask = visible if q > 1 else torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    one_head, mask = heads_as_queries(query, mask)
    packed = masked_attention(one_head, k, v, mask, 0.5, softcap).view(4, G, q, D)
    torch.testing.assert_close(packed, masked_attention(query, k, v, visible, 0.5, softcap))


def test_a_decoding_step_writes_gathers_and_attends_with_the_persistent_mask():
    """A decoded token: one write per buffer, its slots opened in the layer's mask, one gather per buffer (and,
    off the CUDA layout, a copy of the rows), one fused kernel; nothing else launched, the mask kept (until the
    room grows or the samples are reordered)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func._overloadpacket.__name__ not in ("_unsafe_view", "reshape", "alias"):
                self.names.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for cuda_layout in (False, True):
        layer, segments = layer_of([9, 4, 13, 2, 7, 7], batch=2)
        layer.cuda_layout = cuda_layout
        layer.reserve(4)
        segments = step(layer, segments, 1)  # the mask made
        mask = layer.mask(torch.float32)
        new, query = torch.randn(2, 3, 1, D), torch.randn(2, 3 * G, 1, D)
        with Ops() as ops:
            layer.update(new, new)
            layer.attend(query, 0.4)
        gathers = ["index_select"] * 2 if cuda_layout else ["clone", "index_select", "index_select"]
        assert ops.names[:3] == ["copy_", "copy_", "fill_"] and ops.names[3:-1] == gathers, ops.names
        assert "attention" in ops.names[-1], ops.names
        assert layer.mask(torch.float32) is mask and mask.shape[-1] % 16 == 0
        assert torch.equal(mask, layer.index.bias(layer.steps, torch.float32))
        layer.reorder_cache(torch.tensor([1, 1]))  # beam search: a mask of the reordered segments
        assert torch.equal(layer.mask(torch.float32), layer.index.bias(layer.steps, torch.float32))
        assert torch.equal(layer.mask(torch.float32)[:3], mask[3:])


def rounded(layer):
    """width + room a multiple of the power of two <= width / 8 (CUDA's shapes shared by layers and rooms)."""
    width = layer.index.width
    return (width + layer.index.room) % (1 << max(0, width.bit_length() - 4)) == 0


@pytest.mark.parametrize("batch,lengths", [(1, [9, 4, 13]), (2, [9, 4, 13, 2, 7, 7]), (1, [40, 7, 33])])
def test_cuda_layout_attends_as_the_reference(batch, lengths):
    """As on CUDA: the whole room gathered (later steps' slots masked) and heads as queries, across room
    growth, queries of several tokens, a copy, a crop and a reorder."""
    layer, segments = layer_of(lengths, batch)
    layer.cuda_layout = True
    layer.reserve(6)  # room past the steps appended: slots gathered, masked
    assert rounded(layer) and layer.capacity >= 6
    for t, q in enumerate([3, 1, 1, 2] + [1] * 6):
        segments = step(layer, segments, q, seed=t)
    fork = copy.copy(layer)
    step(fork, segments, 1, seed=20)
    step(layer, segments, 2, seed=21)
    layer.crop(-2)
    segments = step(layer, segments, 1, seed=22)
    order = torch.tensor([batch - 1] * batch)
    layer.reorder_cache(order)
    heads = len(lengths) // batch
    segments = [segments[(batch - 1) * heads + s % heads] for s in range(len(lengths))]
    step(layer, segments, 1, seed=23)
    assert rounded(layer)
