"""Per-head budgets on single-head pages (``restkv.vllm.heads``), without vLLM: the page bookkeeping
against brute force, and attention over the flattened batch (a float64 reference kernel reading the
pages) against attention over each head's kept entries held densely."""

import itertools
import math

import numpy as np
import pytest
import torch

from restkv.vllm import heads
from restkv.vllm.paged import Paged


def strided(blocks, block_size, kv_heads, d, dtype=torch.float64):
    """A cache [blocks, block_size, Hkv, 2, d] read as a strided ``Paged``."""
    cache = torch.zeros(blocks, block_size, kv_heads, 2, d, dtype=dtype)
    return Paged(cache, cache[..., 0, :], cache[..., 1, :], block_size)


def packed(blocks, block_size, kv_heads, d, seed=0):
    """A cache whose blocks are permuted element by element (as the CPU backend packs them): a
    ``Paged`` of element offsets."""
    per_block = block_size * kv_heads * 2 * d
    order = torch.randperm(per_block, generator=torch.Generator().manual_seed(seed))
    within = order.view(block_size, kv_heads, 2, d)
    cache = torch.zeros(blocks * per_block, dtype=torch.float64)
    return Paged(cache, within[..., 0, :], within[..., 1, :], block_size, per_block)


@pytest.mark.parametrize("kv_heads,block_size", [(1, 4), (2, 4), (3, 8), (8, 16)])
def test_any_split_of_the_heads_total_fits_the_bound_while_decoding(kv_heads, block_size):
    """Heads sharing Hkv * B entries need at most ceil(B / bs) + 1 blocks, and after t decoded tokens
    no more than vLLM counts for ``equivalent_length(B) + t`` (every split, brute force; ``kv_heads``
    stands for every layer's heads too, whose pages are one pool)."""
    rng = np.random.default_rng(0)
    t = np.arange(2 * block_size + 1)
    for budget in range(1, 3 * block_size + 2):
        total = kv_heads * budget
        if math.comb(total + kv_heads - 1, kv_heads - 1) <= 3000:  # every split
            splits = np.array([s for s in itertools.product(range(total + 1), repeat=kv_heads) if sum(s) == total])
        else:  # the most skewed splits and random ones
            skewed = np.eye(kv_heads, dtype=np.int64) * total
            splits = np.concatenate([skewed, rng.multinomial(total, np.ones(kv_heads) / kv_heads, 3000)])
        grown = splits[:, None, :] + t[None, :, None]  # [splits, t, Hkv]
        pages = -(-grown // block_size)
        blocks = -(-pages.sum(-1) // kv_heads)  # [splits, t]
        counted = -(-(heads.equivalent_length(budget, block_size) + t) // block_size)
        assert (blocks[:, 0] <= heads.bound(budget, block_size)).all()
        assert (blocks <= counted[None]).all()
        assert heads.blocks_for(splits[0], block_size) == blocks[0, 0]


def test_pages_are_the_requests_own_and_never_shared():
    """Layers placing their heads from one pool of the request's pages (every layer's part of every
    block), then decoding: no page is held twice, in any layer; every page held or free is one of the
    request's; each head holds the pages its entries fill; and the request never needs more blocks
    than the scheduler counts at the mean over its layers and heads plus a block."""
    rng = np.random.default_rng(0)
    block_size, kv_heads, layers = 4, 3, 5
    space = heads.Space({f"layer{i}": 100 * i for i in range(layers)}, kv_heads)
    for _ in range(200):
        budget = int(rng.integers(1, 20))
        lengths = rng.multinomial(layers * kv_heads * budget, np.ones(layers * kv_heads) / (layers * kv_heads))
        lengths = lengths.reshape(layers, kv_heads)
        counted = heads.equivalent_length(budget, block_size)
        blocks = list(rng.choice(100, -(-counted // block_size), replace=False))
        free = space.pages(blocks)
        rng.shuffle(free)
        rows = {name: heads.HeadPages.placed(free, n, block_size) for name, n in zip(space.first, lengths)}
        for step in range(int(rng.integers(0, 12))):
            if -(-(counted + step + 1) // block_size) > len(blocks):  # the scheduler's next block
                new = int(rng.choice([b for b in range(100) if b not in blocks]))
                blocks.append(new)
                free += space.pages([new])
            for pages in rows.values():
                pages.append(1)
        mine = set(space.pages(blocks))
        held = [q for pages in rows.values() for row in pages.rows for q in row]
        assert len(held) == len(set(held)) and set(held) | set(free) <= mine
        assert not set(held) & set(free)
        for pages in rows.values():
            assert [len(row) for row in pages.rows] == heads.pages_of(pages.lengths, block_size).tolist()


def test_settle_moves_every_page_into_the_kept_blocks():
    """Pages placed anywhere in the request's blocks, then ``settle`` onto the first blocks: every
    page held is inside them, each head's entries (followed page by page) where they were, the free
    pages the kept blocks' others; more pages than the kept blocks have is refused in one line."""
    rng = np.random.default_rng(1)
    block_size, kv_heads, layers = 4, 2, 3
    space = heads.Space({f"layer{i}": 50 * i for i in range(layers)}, kv_heads)
    for _ in range(100):
        blocks = list(rng.choice(50, 8, replace=False))
        free = space.pages(blocks)
        rng.shuffle(free)
        keep = int(rng.integers(1, 9))
        total = keep * layers * kv_heads * block_size - layers * kv_heads * block_size
        lengths = rng.multinomial(max(total, 0), np.ones(layers * kv_heads) / (layers * kv_heads)).reshape(layers, kv_heads)
        rows = [heads.HeadPages.placed(free, n, block_size) for n in lengths]
        content = {p: (i, h, k) for i, pages in enumerate(rows) for h, row in enumerate(pages.rows) for k, p in enumerate(row)}
        kept = space.pages(blocks[:keep])
        moved_from, moved_to, spare = heads.settle(rows, kept)
        for a, b in zip(moved_from.tolist(), moved_to.tolist()):
            content[b] = content.pop(a)
        for i, pages in enumerate(rows):
            for h, row in enumerate(pages.rows):
                assert set(row) <= set(kept)
                assert [content[p] for p in row] == [(i, h, k) for k in range(len(row))]
        held = {p for pages in rows for row in pages.rows for p in row}
        assert sorted(spare) == sorted(set(kept) - held) and all(pages.free is spare for pages in rows)
    rows = [heads.HeadPages.placed(space.pages([0, 1]), [4, 4], block_size)]
    with pytest.raises(RuntimeError, match="pages held"):
        heads.settle(rows, space.pages([7])[:1])


def test_too_few_pages_is_refused_in_one_line():
    with pytest.raises(RuntimeError, match="pages needed"):
        heads.HeadPages.placed([0, 1], [9, 0], 4)
    p = heads.HeadPages.placed([0, 1], [4, 0], 4)
    p.append(0)
    with pytest.raises(RuntimeError, match="head 0 needs 1 more pages"):
        heads.HeadPages(p.rows, p.lengths, [], 4).append(1)


@pytest.mark.parametrize("make", [strided, packed])
def test_uniform_pages_are_vllms_layout(make):
    """A request as vLLM writes it (every head at the token's slot) reads back head by head through
    its uniform pages."""
    block_size, kv_heads, d = 4, 3, 5
    cache = make(10, block_size, kv_heads, d)
    blocks, n = [7, 2, 5], 10
    keys, values = torch.randn(n, kv_heads, d, dtype=torch.float64), torch.randn(n, kv_heads, d, dtype=torch.float64)
    j = torch.arange(n)
    cache.write(torch.tensor(blocks)[j // block_size] * block_size + j % block_size, keys, values)
    p = heads.HeadPages.uniform(blocks, n, kv_heads, block_size)
    for h in range(kv_heads):
        k, v = cache.read_pages(torch.from_numpy(p.slots(h, 0, n)))
        assert torch.equal(k, keys[:, h]) and torch.equal(v, values[:, h])


def reference_paged_attention(q, cache, batch, scale):
    """Float64 loop: each flattened sequence's queries [c, G, d] over its pages' entries, the i-th of
    its c queries seeing all but the last c - 1 - i entries."""
    out = torch.zeros_like(q)
    bs = cache.block_size
    for i, n in enumerate(batch.seq_lens.tolist()):
        a, b = batch.query_start_loc[i].item(), batch.query_start_loc[i + 1].item()
        j = torch.arange(n)
        slots = batch.block_table[i].long()[j // bs] * bs + j % bs
        k, v = cache.read_pages(slots)
        for t in range(b - a):
            seen = n - (b - a) + t + 1
            w = torch.softmax(q[a + t].double() @ k[:seen].T * scale, -1)
            out[a + t] = w @ v[:seen]
    return out


@pytest.mark.parametrize("make", [strided, packed])
def test_flattened_attention_equals_each_heads_own(make):
    """Requests whose heads keep different numbers of entries, placed on pages, then a step (a
    decoded token for some, a chunk for another): attention over the flattened batch equals
    attention over each head's kept entries and new ones held densely."""
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    block_size, kv_heads, group, d = 4, 2, 3, 6
    cache = make(64, block_size, kv_heads, d)
    free = list(rng.permutation(64))
    counts = [1, 3, 1]
    dense, pages, appended = [], [], []
    for r, c in enumerate(counts):
        budget = 5 + r
        lengths = rng.multinomial(kv_heads * budget, [0.8, 0.2])
        blocks = [free.pop() for _ in range(heads.bound(budget, block_size) + 2)]
        p = heads.HeadPages.placed(heads.Space({"layer": 0}, kv_heads).pages(blocks), lengths, block_size)
        kept = [(torch.randn(n, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)) for n in lengths]
        for h, (k, v) in enumerate(kept):
            cache.write_pages(torch.from_numpy(p.slots(h, 0, len(k))), k, v)
        new_k, new_v = torch.randn(c, kv_heads, d, dtype=torch.float64), torch.randn(c, kv_heads, d, dtype=torch.float64)
        slots = p.append(c)
        for h in range(kv_heads):
            cache.write_pages(torch.from_numpy(slots[h]), new_k[:, h], new_v[:, h])
        dense.append([(torch.cat([k, new_k[:, h]]), torch.cat([v, new_v[:, h]])) for h, (k, v) in enumerate(kept)])
        pages.append(p)
        appended.append(slots)
    batch = heads.FlatBatch.layers({"layer": pages}, counts, "cpu", {"layer": appended})["layer"]
    q = torch.randn(sum(counts), kv_heads * group, d, dtype=torch.float64)
    scale = d**-0.5
    rows = rows_of(range(len(q)), kv_heads)
    out = torch.zeros_like(q)
    heads.unflatten(out, rows, kv_heads, reference_paged_attention(heads.flatten(q, rows, kv_heads), cache, batch, scale))
    start = 0
    for c, held in zip(counts, dense):
        for h, (k, v) in enumerate(held):
            for t in range(c):
                seen = len(k) - c + t + 1
                for g in range(group):
                    w = torch.softmax(q[start + t, h * group + g] @ k[:seen].T * scale, -1)
                    torch.testing.assert_close(out[start + t, h * group + g], w @ v[:seen], rtol=0, atol=1e-12)
        start += c
    # the step's slots as one mapping, head-major and token-major within a head
    j = 0
    for h in range(kv_heads):
        for p, c in zip(pages, counts):
            assert batch.slot_mapping[j : j + c].tolist() == p.slots(h, int(p.lengths[h]) - c, c).tolist()
            j += c


def rows_of(tokens, kv_heads: int) -> tuple:
    """The flattened rows of ``tokens`` (``heads.flat_rows``) as tensors."""
    return tuple(torch.from_numpy(a) for a in heads.flat_rows(np.asarray(tokens), kv_heads))


def test_flatten_round_trips():
    x = torch.randn(7, 6, 4)
    out = torch.zeros_like(x)
    every, some = rows_of(range(7), 2), rows_of([1, 4], 2)
    heads.unflatten(out, every, 2, heads.flatten(x, every, 2))
    assert torch.equal(out, x)
    assert torch.equal(heads.flatten(x, every, 2)[7 + 3], x[3, 3:6])  # head 1, token 3: query heads 3..5
    strided = torch.randn(7, 12, 4)[:, ::2]  # queries as a view of a wider projection
    assert torch.equal(heads.flatten(strided, some, 2), torch.stack([strided[t, 3 * h : 3 * h + 3] for h in (0, 1) for t in (1, 4)]))
    part = torch.zeros(7, 24)
    heads.unflatten(part, some, 2, heads.flatten(x, some, 2))
    assert torch.equal(part.view(7, 6, 4)[[1, 4]], x[[1, 4]]) and not part.view(7, 6, 4)[[0, 2, 3, 5, 6]].any()


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_head_pages_view_the_cache_the_backend_reads(kv_heads):
    """``paged.head_pages``: a head-major cache [blocks, Hkv, N, 2 d] (contiguous, or a block-strided
    view of a larger buffer) seen as single-head pages is a view of the same memory, page b Hkv + h
    holding what ``Paged.read_pages`` reads there; a block whose heads interleave (NHD) is refused in
    one line, never copied (a copy would be attended while the cache changes)."""
    from restkv.vllm.paged import head_pages

    block_size, d = 4, 5
    base = torch.randn(7, kv_heads, block_size, 2 * d + 3, dtype=torch.float64)
    for cache in (base[..., : 2 * d].contiguous(), base[..., : 2 * d]):
        pages = head_pages(cache)
        assert pages.data_ptr() == cache.data_ptr() and pages.shape == (7 * kv_heads, 1, block_size, 2 * d)
        view = Paged(cache, cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2), block_size)
        slots = torch.arange(7 * kv_heads * block_size)
        keys, values = view.read_pages(slots)
        assert torch.equal(pages[:, 0, :, :d].reshape(-1, d), keys)
        assert torch.equal(pages[:, 0, :, d:].reshape(-1, d), values)
        pages[kv_heads - 1, 0, 1, 0] = 42.0  # page Hkv - 1: block 0's last head
        assert cache[0, kv_heads - 1, 1, 0] == 42.0
    if kv_heads > 1:
        interleaved = torch.zeros(7, block_size, kv_heads, 2 * d).transpose(1, 2)  # NHD in memory
        with pytest.raises(ValueError, match="not head-major"):
            head_pages(interleaved)


def test_a_steps_flattened_batch_goes_to_the_device_in_two_copies_that_do_not_wait(monkeypatch):
    """``FlatBatch.layers`` moves every layer's offsets, lengths and page tables (int32, as the backends
    read them) with one copy and the slots (int64) with another (``heads.stage``): on CUDA non-blocking from
    pinned memory (a copy from pageable memory waits for the device: a host sync per decoded token). The
    CUDA tensor is faked (its copy recorded, the data kept on the CPU), so the batch read back must be
    the one built on the CPU, each array in the dtype it is staged in (no second copy of another)."""

    def batch(device):  # two requests of two heads (5 and 9 entries), one token and two in the step
        pages = [heads.HeadPages.placed(list(range(r * 8, r * 8 + 8)), [5, 9], 4) for r in range(2)]
        appended = {"l0": [p.append(c) for p, c in zip(pages, (1, 2))]}
        return heads.FlatBatch.layers({"l0": pages}, [1, 2], device, appended)["l0"]

    want = batch("cpu")
    copies, to = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: copies.append("pinned") or self)
    monkeypatch.setattr(
        torch.Tensor, "to", lambda self, device, **kw: copies.append((str(device), kw)) or to(self, "cpu")
    )
    got = batch(torch.device("cuda"))
    assert copies == ["pinned", ("cuda", {"non_blocking": True})] * 2
    for field, dtype in [("query_start_loc", torch.int32), ("seq_lens", torch.int32), ("block_table", torch.int32),
                         ("slot_mapping", torch.int64)]:  # fmt: skip
        assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert getattr(got, field).dtype == dtype, field
