"""The paged cache layouts of vLLM's attention backends, built on CPU as each backend defines them,
read and written by ``restkv.vllm.paged`` (no vLLM needed).

vLLM 0.32 and 0.33 hand every GPU backend (FlashAttention, FlashInfer, Triton) a layer's cache as a
logical ``[blocks, KV heads, block_size, 2 d]`` tensor, keys then values on the last axis, whose
physical order is one of ``vllm.v1.kv_cache_layout.KVCacheLayout`` (a permutation of ``[layers,
blocks, heads, tokens, content]``, copied below); their writer (``reshape_and_cache_flash``) puts
token t's key of head h at ``kv_cache.transpose(1, 2)[block, offset, h, :d]``. The CPU backend packs
each block for its ISA (``paged.probed``, from its own writer; tests/vllm_plugin runs it in vLLM).
"""

from __future__ import annotations

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


def layer_caches(order, layers, blocks, heads, size, d, dtype):
    """Every layer's logical [B, H, N, 2 d] view of one physical tensor allocated in ``order``
    (as vLLM's model runner allocates a group's cache and views each layer)."""
    logical = (layers, blocks, heads, size, 2 * d)
    physical = torch.zeros([logical[i] for i in order], dtype=dtype)
    view = physical.permute([order.index(i) for i in range(5)])  # back to logical axis order
    return [view[i] for i in range(layers)]


def flash_writer(kv_cache, keys, values, slots):
    """``reshape_and_cache_flash`` as FlashAttention's ``do_kv_cache_update`` calls it."""
    d = keys.shape[-1]
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    size = kv_cache.shape[2]
    block, offset = slots // size, slots % size
    key_cache[block, offset] = keys
    value_cache[block, offset] = values


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("size, heads, d", [(16, 1, 64), (32, 2, 128), (16, 8, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_declared_layouts_read_back_what_the_backend_writes(layout, size, heads, d, dtype):
    g = torch.Generator().manual_seed(0)
    blocks, n = 9, 40
    slots = torch.randperm(blocks * size, generator=g)[:n]
    keys, values = (torch.randn(n, heads, d, generator=g).to(dtype) for _ in range(2))
    written = layer_caches(LAYOUTS[layout], 3, blocks, heads, size, d, dtype)
    flash_writer(written[1], keys, values, slots)  # the middle layer of three
    ours = paged.declared(written[1], d)
    rk, rv = ours.read(slots)
    assert torch.equal(rk, keys) and torch.equal(rv, values)
    blank = layer_caches(LAYOUTS[layout], 3, blocks, heads, size, d, dtype)
    paged.declared(blank[1], d).write(slots, keys, values)
    for a, b in zip(blank, written):
        assert torch.equal(a, b)  # the same elements, and no other layer touched


def test_a_batch_of_requests_moves_its_kept_entries_into_its_own_blocks():
    """Each request's kept rows (their order) land in its own blocks' first slots; another
    request's blocks are untouched."""
    g = torch.Generator().manual_seed(1)
    size, heads, d = 16, 2, 64
    (cache,) = layer_caches(LAYOUTS["LBNHC"], 1, 12, heads, size, d, torch.float32)
    cache.copy_(torch.randn(cache.shape, generator=g))
    before = cache.clone()
    layer = paged.declared(cache, d)
    requests = {"a": [3, 7, 1], "b": [5, 0]}
    kept = {"a": torch.tensor([40, 2, 17, 33, 5]), "b": torch.tensor([9, 20, 1])}
    for name, ids in requests.items():
        held = torch.tensor(ids)[torch.arange(len(ids) * size) // size] * size + torch.arange(len(ids) * size) % size
        k, v = layer.read(held[kept[name]])
        target = held[: len(kept[name])]
        layer.write(target, k, v)
        rk, rv = layer.read(target)
        ek, ev = paged.declared(before, d).read(held[kept[name]])
        assert torch.equal(rk, ek) and torch.equal(rv, ev)
    untouched = [b for b in range(12) if b not in (3, 5)]
    assert torch.equal(cache[untouched], before[untouched])
