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


# an FP8 cache's float8 types: (the type, exponent bits, mantissa bits, exponent bias)
FP8 = [(torch.float8_e4m3fn, 4, 3, 7), (torch.float8_e5m2, 5, 2, 15)]


def fp8_bytes(shape, exponent: int, mantissa: int, g) -> torch.Tensor:
    """Random float8 bytes [shape] uint8, none NaN or infinite (the all-ones exponent's of e5m2, e4m3's
    0x7f / 0xff)."""
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    top = (raw.long() >> mantissa) & (2**exponent - 1)
    bad = top == 2**exponent - 1
    if exponent == 4:  # e4m3fn: only the all-ones pattern of exponent and mantissa is NaN
        bad &= (raw.long() & (2**mantissa - 1)) == 2**mantissa - 1
    return torch.where(bad, raw & 0x80, raw)


def fp8_value(raw: torch.Tensor, exponent: int, mantissa: int, bias: int) -> torch.Tensor:
    """float64 values of float8 bytes, from their bits: sign, exponent, mantissa (subnormal at exponent 0)."""
    r = raw.long()
    sign = 1 - 2 * (r >> 7).double()
    e, m = (r >> mantissa) & (2**exponent - 1), (r & (2**mantissa - 1)).double()
    normal = (1 + m / 2**mantissa) * torch.pow(2.0, (e - bias).double())
    subnormal = m / 2**mantissa * 2.0 ** (1 - bias)
    return sign * torch.where(e > 0, normal, subnormal)


@pytest.mark.parametrize("fp8, exponent, mantissa, bias", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
@pytest.mark.parametrize("block_size, tokens, heads, d, axis", [CASES[1], CASES[3], CASES[5]])
def test_an_fp8_page_reads_through_its_scales_and_moves_its_bytes(
    fp8, exponent, mantissa, bias, layout, block_size, tokens, heads, d, axis
):
    """Keys and values read as their bytes' values times the layer's scales (float32, against float64
    from the bits), and kept entries (head h's ``held[positions[h]]``) copied byte for byte."""
    g = torch.Generator().manual_seed(2)
    order, blocks, n = LAYOUTS[layout], 9 * block_size // tokens, 40
    page, slots_declared = ((heads, 2 * d), None) if axis == "last" else ((2 * heads, d), 2 * heads)
    logical = (LAYERS, blocks, page[0], tokens, page[1])
    placed, layers = allocate(order, blocks, page, tokens, torch.uint8)
    placed.copy_(fp8_bytes(placed.shape, exponent, mantissa, g))
    scales = torch.tensor(0.37), torch.tensor(2.5)
    ours = paged.declared(layers[1], "TEST", heads, d, block_size, torch.bfloat16, slots_declared, (fp8, *scales))
    slots = torch.randperm(blocks * tokens, generator=g)[:n]
    at = elements(order, logical, 1, slots, block_size, heads, d, axis)
    for read, where, scale in zip(ours.read(slots), at, scales):
        assert read.dtype == torch.float32
        expected = fp8_value(placed[where], exponent, mantissa, bias) * scale.double()
        assert torch.allclose(read.double(), expected, rtol=2**-23, atol=0)

    positions = torch.randint(0, n, (heads, 7), generator=g)
    target = slots[:7]
    blank, blank_layers = allocate(order, blocks, page, tokens, torch.uint8)
    moved = paged.declared(blank_layers[1], "TEST", heads, d, block_size, torch.bfloat16, slots_declared, (fp8, *scales))
    moved.write(target, *ours.stored(slots, positions))
    expected = torch.zeros_like(blank)
    at_target = elements(order, logical, 1, target, block_size, heads, d, axis)
    for source, dest in zip(at, at_target):
        for h in range(heads):
            expected[dest[:, h]] = placed[source[positions[h], h]]
    assert torch.equal(blank, expected)  # the kept bytes, and no other


def cpu_like_fp8_writer(cache, keys, values, slots):
    """A packed block as vLLM's CPU backend writes FP8 at unit scales: a block and head's keys as
    [d, N] bytes, then its values as [N, d]."""
    blocks, heads, size, width = cache.shape
    d = width // 2
    flat = cache.view(blocks, heads, 2, size * d)
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, size)
        k, v = (x[i].to(torch.float8_e4m3fn).view(torch.uint8) for x in (keys, values))
        flat[b, :, 0, torch.arange(d) * size + t] = k
        flat[b, :, 1, t * d + torch.arange(d)] = v


def test_a_probed_fp8_page_reads_through_its_scales():
    """The CPU backend's packing, found off an FP8 writer (base-8 digits, which e4m3 bytes hold)."""
    g = torch.Generator().manual_seed(3)
    blocks, heads, size, d = 5, 2, 32, 64
    cache = fp8_bytes((blocks, heads, size, 2 * d), 4, 3, g)
    scales = torch.tensor(0.5), torch.tensor(3.0)
    ours = paged.probed(cache, size, heads, d, cpu_like_fp8_writer, "fp8-test", (torch.float8_e4m3fn, *scales))
    slots = torch.randperm(blocks * size, generator=g)[:30]
    flat = cache.view(blocks, heads, 2, d * size)
    b, t = slots // size, slots % size
    c = torch.arange(d)
    key_bytes = flat[b[:, None, None], torch.arange(heads)[None, :, None], 0, c * size + t[:, None, None]]
    value_bytes = flat[b[:, None, None], torch.arange(heads)[None, :, None], 1, t[:, None, None] * d + c]
    for read, raw, scale in zip(ours.read(slots), (key_bytes, value_bytes), scales):
        assert torch.allclose(read.double(), fp8_value(raw, 4, 3, 7) * scale.double(), rtol=2**-23, atol=0)


def test_an_fp8_page_refuses_entries_not_as_stored():
    cache = torch.zeros(4, 2, 16, 128, dtype=torch.uint8)
    ours = paged.declared(cache, "TEST", 2, 64, 16, torch.bfloat16, None, (torch.float8_e4m3fn, torch.tensor(1.0), torch.tensor(1.0)))
    entries = torch.ones(3, 2, 64)
    with pytest.raises(ValueError, match="written as stored"):
        ours.write(torch.arange(3), entries, entries)
