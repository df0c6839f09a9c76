"""Per-head budgets through vLLM's own CPU attention kernel (``restkv.vllm.heads``): a layer's cache
``[blocks, Hkv, block_size, 2 d]`` viewed as single-head pages ``[blocks Hkv, 1, block_size, 2 d]``,
the batch flattened to one sequence per (KV head, request), and the ops the CPU backend's ``forward``
calls (its scheduler metadata, then ``cpu_attention_with_kv_cache``) run on it with G query heads on
one KV head. Entries are written as the plugin writes them (``Paged.write_pages`` through the layout
probed from the backend's own writer), so the ISA's packing of a block is exercised too.

Checked: a request laid out by vLLM (uniform) gives the same output through the flattened view as
through the backend's own call; requests whose heads hold different numbers of entries give
attention over each head's entries held densely.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from harness import assert_each_head_attends_its_entries, cpu_isa, heads_on_pages  # noqa: E402
from restkv.vllm import heads
from restkv.vllm.hooks import attention

pytestmark = pytest.mark.quick


def kernel(query, cache, batch, kv_heads, isa, scale):
    """The CPU backend's attention ops on ``cache`` [blocks, Hkv, bs, 2 d] for ``batch`` (its
    ``query_start_loc``, ``seq_lens``, ``block_table``); query [T, Hq, d] -> [T, Hq, d]."""
    blocks, hkv, size, _ = cache.shape
    t, hq, d = query.shape
    key_cache, value_cache = cache.view(blocks, hkv, 2 * size, d).chunk(2, dim=2)
    output = torch.empty_like(query)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(batch.seq_lens), num_heads=hq, num_kv_heads=hkv, head_dim=d,
        seq_lens=batch.seq_lens, dtype=query.dtype, query_start_loc=batch.query_start_loc,
        causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )  # fmt: skip
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, scale=scale, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=batch.block_table, softcap=0.0,
        scheduler_metadata=meta, s_aux=None,
    )  # fmt: skip
    return output


def single_head_pages(cache):
    """[blocks, Hkv, bs, 2 d] -> [blocks Hkv, 1, bs, 2 d]: page ``b Hkv + h`` is block b's head h."""
    return cache.flatten(0, 1).unsqueeze(1)


def flat(query, cache, batch, kv_heads, isa, scale):
    rows = tuple(torch.from_numpy(a) for a in heads.flat_rows(np.arange(len(query)), kv_heads))
    out = torch.zeros_like(query)
    heads.unflatten(out, rows, kv_heads, kernel(heads.flatten(query, rows, kv_heads), single_head_pages(cache), batch, 1, isa, scale))
    return out


def setup(dtype, block_size=32, kv_heads=2, d=64, blocks=24):
    isa = _get_attn_isa(dtype, block_size, d, "auto")
    cache = torch.zeros(blocks, kv_heads, block_size, 2 * d, dtype=dtype)
    layer, impl = SimpleNamespace(isa=isa, kv_cache_dtype="auto", dtype=dtype), SimpleNamespace(head_size=d)
    return cache, attention.cpu(impl, layer, cache, block_size), isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_uniform_request_reads_the_same_through_single_head_pages(dtype):
    torch.manual_seed(0)
    kv_heads, group, d, bs = 2, 3, 64, 32
    cache, paged, isa = setup(dtype, bs, kv_heads, d)
    blocks, n, c = [5, 1, 9, 3], 100, 4
    j = torch.arange(n)
    slots = torch.tensor(blocks)[j // bs] * bs + j % bs
    paged.write(slots, torch.randn(n, kv_heads, d, dtype=dtype), torch.randn(n, kv_heads, d, dtype=dtype))
    query = torch.randn(c, kv_heads * group, d, dtype=dtype)
    width = -(-n // bs)
    own = SimpleNamespace(
        query_start_loc=torch.tensor([0, c], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([blocks[:width]], dtype=torch.int32),
    )
    pages = heads.HeadPages.uniform(blocks, n, kv_heads, bs)
    step = np.stack([pages.slots(h, n - c, c) for h in range(kv_heads)])  # the step's c tokens, last in every head
    batch = heads.FlatBatch.layers({"layer": [pages]}, [c], "cpu", {"layer": [step]})["layer"]
    torch.testing.assert_close(
        flat(query, cache, batch, kv_heads, isa, d**-0.5), kernel(query, cache, own, kv_heads, isa, d**-0.5)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_of_different_lengths_attend_to_their_own_entries(dtype):
    rng, g = np.random.default_rng(1), torch.Generator().manual_seed(1)
    kv_heads, group, d, bs = 2, 3, 64, 32
    cache, paged, isa = setup(dtype, bs, kv_heads, d, blocks=40)
    free = list(rng.permutation(40))
    counts = [1, 5, 1]
    batch, entries = heads_on_pages(paged.write_pages, counts, [40, 70, 33], [0.85, 0.15], bs, free, rng, g, d, dtype)
    query = torch.randn(sum(counts), kv_heads * group, d, generator=g).to(dtype)
    out = flat(query, cache, batch, kv_heads, isa, d**-0.5)
    assert_each_head_attends_its_entries(out, query, entries, counts, d**-0.5, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backends_writer_on_single_head_pages_writes_the_bytes_it_writes_in_blocks(dtype, kv_cache_dtype):
    """``attention.single_head`` writes a step's entries with the backend's own ``do_kv_cache_update`` on the
    single-head pages (one KV head each): every byte lands where the same writer puts it in the block's
    head (an FP8 cache's quantized by vLLM's own kernel, at the layer's scales), the ISA's packing too."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from restkv.vllm import paged

    isa = cpu_isa(dtype, kv_cache_dtype)
    g = torch.Generator().manual_seed(0)
    blocks, kv_heads, bs, d = 8, 3, 32, 64
    store = torch.uint8 if kv_cache_dtype == "fp8" else dtype
    layer = SimpleNamespace(isa=isa, _k_scale_float=0.5, _v_scale_float=2.0)
    impl = SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype=kv_cache_dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:150]
    keys, values = (torch.randn(len(slots), kv_heads, d, generator=g).mul(40).to(dtype) for _ in range(2))
    in_blocks, on_pages = (torch.zeros(blocks, kv_heads, bs, 2 * d, dtype=store) for _ in range(2))
    CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, keys, values, in_blocks, slots)
    pages = paged.head_pages(on_pages)
    for h in range(kv_heads):
        page_slots = (slots // bs * kv_heads + h) * bs + slots % bs
        CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, keys[:, h : h + 1], values[:, h : h + 1], pages, page_slots)
    assert in_blocks.view(torch.uint8).count_nonzero() > 0
    assert torch.equal(in_blocks.view(torch.uint8), on_pages.view(torch.uint8))
