"""The GPU backends' paged cache as ``restkv.vllm.paged.declared`` reads and writes it, on CPU without
vLLM, against a brute-force map of where each layout puts each entry.

vLLM (0.32 and 0.33) views each layer of a cache group as a logical ``[blocks, H, N, C]`` page of one
tensor allocated in a ``vllm.v1.kv_cache_layout.KVCacheLayout`` order (a permutation of ``[layers,
blocks, heads, tokens, content]``, copied below; ``tests/vllm_plugin/test_layouts_vllm.py`` checks
the copy and builds the pages with vLLM's own functions and writers). The map here is the layout's
definition in arithmetic: physical axis k's stride is the product of the later axes' sizes; the
entry of slot s (the engine's block s // M, its kernel block of N tokens inside it), KV head h and
channel c is the key at content c (head h + Hkv, content c: on the head axis) and the value at
content d + c. The CPU backend's ISA-packed blocks: ``paged.probed`` (tests/vllm_plugin, in vLLM).
"""

from __future__ import annotations

import math

import pytest
import torch

from restkv.vllm import paged

# vllm/v1/kv_cache_layout.py: KVCacheLayout, physical order of the logical [L, B, H, N, C] axes
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LAYERS = 3

# (engine block M, kernel block N, Hkv, d, K/V axis: "last" [B, Hkv, N, 2d], "head" [B, 2Hkv, N, d])
CASES = [
    (16, 16, 1, 64, "last"),
    (32, 32, 2, 128, "last"),
    (16, 16, 8, 64, "last"),
    (64, 16, 2, 64, "last"),  # a block split into kernel blocks (FlashInfer's fixed sizes)
    (16, 16, 2, 64, "head"),
    (32, 16, 4, 32, "head"),
]


def allocate(order, blocks, page, size, dtype):
    """(flat buffer, each layer's logical [B, H, N, C] view) of one tensor allocated in ``order``."""
    logical = (LAYERS, blocks, page[0], size, page[1])
    physical = torch.zeros([logical[i] for i in order], dtype=dtype)
    view = physical.permute([order.index(i) for i in range(5)])  # back to logical axis order
    return physical.view(-1), list(view)


def elements(order, logical, layer, slots, block_size, heads, d, axis):
    """Brute force: the flat element of each (slot, KV head, channel) of the keys and of the values,
    [n, Hkv, d] each, in ``layer`` of a buffer whose logical shape is ``logical``."""
    sizes = [logical[i] for i in order]
    stride = {axis_: math.prod(sizes[k + 1 :]) for k, axis_ in enumerate(order)}
    tokens = logical[3]
    s = slots[:, None, None]
    block = s // block_size * (block_size // tokens) + s % block_size // tokens
    h, c = torch.arange(heads)[None, :, None], torch.arange(d)[None, None, :]
    found = []
    for kind in (0, 1):
        head, content = (h, c + kind * d) if axis == "last" else (h + kind * heads, c)
        index = (layer, block, head, s % block_size % tokens, content)
        found.append(sum(index[i] * stride[i] for i in range(5)))
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block_size, tokens, heads, d, axis", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_declared_pages_hold_each_entry_where_the_layout_puts_it(
    layout, block_size, tokens, heads, d, axis, dtype
):
    g = torch.Generator().manual_seed(0)
    order, blocks, n = LAYOUTS[layout], 9 * block_size // tokens, 40
    page, slots_declared = ((heads, 2 * d), None) if axis == "last" else ((2 * heads, d), 2 * heads)
    slots = torch.randperm(blocks * tokens, generator=g)[:n]
    keys, values = (torch.randn(n, heads, d, generator=g).to(dtype) for _ in range(2))
    logical = (LAYERS, blocks, page[0], tokens, page[1])
    at_keys, at_values = elements(order, logical, 1, slots, block_size, heads, d, axis)
    placed, layers = allocate(order, blocks, page, tokens, dtype)
    placed[at_keys], placed[at_values] = keys, values  # the middle layer of three
    ours = paged.declared(layers[1], "TEST", heads, d, block_size, dtype, slots_declared)
    read_keys, read_values = ours.read(slots)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    blank, blank_layers = allocate(order, blocks, page, tokens, dtype)
    paged.declared(blank_layers[1], "TEST", heads, d, block_size, dtype, slots_declared).write(
        slots, keys, values
    )
    assert torch.equal(blank, placed)  # those elements, and no other (nor another layer's)


def test_a_batch_of_requests_moves_its_kept_entries_into_its_own_blocks():
    """Each request's kept rows (their order) land in its own blocks' first slots; another
    request's blocks are untouched."""
    g = torch.Generator().manual_seed(1)
    size, heads, d = 16, 2, 64
    _, (cache, *_) = allocate(LAYOUTS["LBNHC"], 12, (heads, 2 * d), size, torch.float32)
    cache.copy_(torch.randn(cache.shape, generator=g))
    before = cache.clone()

    def layer(c):
        return paged.declared(c, "TEST", heads, d, size, torch.float32)

    requests = {"a": [3, 7, 1], "b": [5, 0]}
    kept = {"a": torch.tensor([40, 2, 17, 33, 5]), "b": torch.tensor([9, 20, 1])}
    for name, ids in requests.items():
        j = torch.arange(len(ids) * size)
        held = torch.tensor(ids)[j // size] * size + j % size
        k, v = layer(cache).read(held[kept[name]])
        target = held[: len(kept[name])]
        layer(cache).write(target, k, v)
        rk, rv = layer(cache).read(target)
        ek, ev = layer(before).read(held[kept[name]])
        assert torch.equal(rk, ek) and torch.equal(rv, ev)
    untouched = [b for b in range(12) if b not in (3, 5)]
    assert torch.equal(cache[untouched], before[untouched])


# (page [B, H, N, C], its dtype, declared head slots, Hkv, d, engine block, what the error names)
REFUSED = [
    ((4, 2, 16, 128), torch.uint8, None, 2, 64, 16, "not the model's torch.bfloat16"),
    ((4, 3, 16, 128), torch.bfloat16, None, 2, 64, 16, "not [blocks, 2, a divisor"),
    ((4, 2, 16, 128), torch.bfloat16, None, 2, 64, 24, "a divisor of the block size 24"),
    ((4, 2, 16, 64), torch.bfloat16, 2, 1, 64, 16, "ambiguous"),  # K/V heads or two planes
    ((4, 2, 16, 128), torch.bfloat16, 2, 2, 64, 16, "2 head slots for 2 KV heads"),  # two planes
    ((4, 2, 16, 128), torch.bfloat16, 4, 2, 64, 16, "not [blocks, 4, a divisor"),
    ((4, 2, 16, 2, 64), torch.bfloat16, None, 2, 64, 16, "not [blocks, 2, a divisor"),
]


@pytest.mark.parametrize("shape, dtype, slots, heads, d, block_size, names", REFUSED)
def test_a_page_the_spec_does_not_declare_is_refused_in_one_line(
    shape, dtype, slots, heads, d, block_size, names
):
    cache = torch.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError) as refused:
        paged.declared(cache, "FLASH_ATTN", heads, d, block_size, torch.bfloat16, slots)
    message = str(refused.value)
    assert "FLASH_ATTN" in message and names in message and "\n" not in message
