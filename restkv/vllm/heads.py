"""Per-head and per-layer budgets in vLLM's paged cache: every layer's cache seen as single-head pages
of one pool (no vLLM import).

vLLM gives a request one block table and one length: every KV head of a block holds the same
``block_size`` positions, in every layer. Where a block's interior is head-major (the CPU backend's
``[blocks, Hkv, block_size, 2 d]``; the GPU backends' ``HND`` layout), block ``b`` of a layer is also
``Hkv`` single-head pages, each holding ``block_size`` entries of one head. vLLM keeps every layer's cache
in one allocation, layer after layer (its layer-compact layouts, the CPU backend's only one), so the
layers' blocks are blocks of one tensor too (``Space``: layer ``l``'s block ``b`` is its block
``first[l] + b``, page ``(first[l] + b) Hkv + h`` head h of it, slot ``page * block_size + j`` the j-th
entry; ``restkv.vllm.paged.Paged.read_pages`` / ``write_pages`` read and write them through the
backend's own layout).

Seen so, a request's blocks are a pool of ``layers * Hkv`` pages per block that every head of every layer
draws from (``HeadPages``: one request's heads in one layer, the request's free pages shared by its
layers): after an eviction that keeps ``n_lh`` entries in head ``h`` of layer ``l``, that head holds them on
``ceil(n_lh / block_size)`` pages of its own, in any layer's part of any of the request's blocks, and the
request needs ``ceil(sum ceil(n_lh / block_size) / (layers Hkv))`` blocks: at most
``ceil(mean / block_size) + 1`` for a mean of ``mean`` entries per head over every layer and head
(``bound``), one block above what uniform budgets of that mean hold, whatever the split over heads and
layers; and as every head gains one entry per decoded token, the bound grows by one block every
``block_size`` tokens, as vLLM's own count does. So the scheduler counts a request at its mean plus a
block (``equivalent_length``), as it counts uniform budgets at theirs, while the worker places the pages.

An eviction places a layer's kept entries on pages no other layer still needs: the fresh blocks of a
first eviction under prefix caching, the layer's own pages once it has read them, pages other layers
gave up earlier in the step; at the step's end the pages outside the blocks the request keeps move into
free pages inside them (``settle``), once every layer has read what it held.

Attention runs through the backend's own kernel over the flattened batch (``flatten`` /
``unflatten``, ``FlatBatch``): each (KV head ``h``, request ``r``) is a sequence of its own, with its
G query heads on one KV head, its row of pages and its length, so no attention code is written per
backend. Layers differ only in their pages and lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def pages_of(lengths, block_size: int) -> np.ndarray:
    """[Hkv] pages each head's ``lengths`` fill."""
    return -(-np.asarray(lengths, dtype=np.int64) // block_size)


def blocks_for(lengths, block_size: int) -> int:
    """Blocks a request needs for heads holding ``lengths`` [..., Hkv] entries (every layer's: the
    pages of a block are its layers' and heads')."""
    lengths = np.asarray(lengths)
    return int(-(-int(pages_of(lengths, block_size).sum()) // lengths.size))


def bound(budget: int, block_size: int) -> int:
    """The most blocks heads sharing ``layers * Hkv * budget`` entries need, whatever their split."""
    return -(-budget // block_size) + 1


def equivalent_length(budget: int, block_size: int) -> int:
    """The length the scheduler counts for a request whose heads hold ``budget`` entries on average, whatever
    their split: ``bound(budget)`` blocks now, one more block every ``block_size`` decoded tokens (the bound
    until the worker counts the heads' own, ``exact_length``)."""
    return budget + block_size


def exact_length(lengths, block_size: int) -> int:
    """The shortest length the scheduler can count a request at whose heads hold ``lengths`` [layers * Hkv]
    entries (every layer's and head's, ``lengths.size`` pages to a block), so that while every head appends
    one entry per token its blocks always hold the heads' pages: for each t of the next ``block_size`` tokens,
    ``ceil((length + t) / block_size)`` blocks hold ``sum ceil((lengths + t) / block_size)`` pages (the need
    repeats, one block more, every ``block_size`` tokens). At most ``equivalent_length`` of their mean."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    t = np.arange(block_size)
    pages = pages_of(lengths[:, None] + t, block_size).sum(0)  # [block_size] the heads' pages after t tokens
    blocks = -(-pages // lengths.size)
    return int(max(1, ((blocks - 1) * block_size + 1 - t).max()))  # ceil((length + t) / bs) >= blocks


@dataclass(frozen=True)
class Space:
    """Where a worker's single-head pages are: every layer's cache as blocks of one tensor, layer
    ``name``'s block ``b`` its block ``first[name] + b``, head ``h`` of it page ``block * heads + h``."""

    first: dict
    heads: int

    def pages(self, blocks, layers=None) -> list:
        """The pages of ``blocks`` (the request's block ids) in ``layers`` (names; None: every layer),
        layer by layer, block by block, head by head."""
        blocks = np.asarray(blocks, dtype=np.int64)
        names = self.first if layers is None else layers
        return [
            int(p)
            for name in names
            for p in ((self.first[name] + blocks)[:, None] * self.heads + np.arange(self.heads)).reshape(-1)
        ]


def settle(layers: list, kept: list) -> tuple[np.ndarray, np.ndarray, list]:
    """Move every page of ``layers`` (a request's ``HeadPages``) outside ``kept`` (the pages of the
    blocks it keeps) to a page of ``kept`` no head holds -> (from pages, to pages, the pages of ``kept``
    left free). The rows are changed in place; the caller copies the pages' entries."""
    inside = set(kept)
    held = {p for pages in layers for row in pages.rows for p in row}
    spare = [p for p in kept if p not in held]
    moved_from, moved_to = [], []
    for pages in layers:
        for row in pages.rows:
            for i, p in enumerate(row):
                if p not in inside:
                    if len(moved_to) == len(spare):
                        raise RuntimeError(
                            f"restkv.vllm: {len(held)} pages held, {len(kept)} in the blocks the request keeps"
                        )
                    row[i] = spare[len(moved_to)]
                    moved_from.append(p)
                    moved_to.append(row[i])
    spare = spare[len(moved_to) :]
    for pages in layers:
        pages.free = spare
    return np.asarray(moved_from, dtype=np.int64), np.asarray(moved_to, dtype=np.int64), spare


@dataclass
class HeadPages:
    """One request's pages in one layer: ``rows[h]`` head h's pages in order, ``lengths[h]`` its
    entries, ``free`` the pages of the request's blocks no head holds (one list, shared by the
    request's layers)."""

    rows: list
    lengths: np.ndarray
    free: list
    block_size: int

    @classmethod
    def uniform(cls, blocks, length: int, heads: int, block_size: int) -> "HeadPages":
        """A request as vLLM lays it out: every head's entries on its own page of each block."""
        used = -(-length // block_size)
        rows = [[b * heads + h for b in blocks[:used]] for h in range(heads)]
        free = [b * heads + h for b in blocks[used:] for h in range(heads)]
        return cls(rows, np.full(heads, length, dtype=np.int64), free, block_size)

    @classmethod
    def placed(cls, free: list, lengths, block_size: int) -> "HeadPages":
        """Heads holding ``lengths`` [Hkv] entries on the first pages of ``free`` (taken from it, in
        order, head by head); raises if they do not fit."""
        need = pages_of(lengths, block_size)
        if need.sum() > len(free):
            raise RuntimeError(f"restkv.vllm: {int(need.sum())} pages needed, {len(free)} free")
        ends = np.cumsum(need)
        rows = [free[e - n : e] for n, e in zip(need.tolist(), ends.tolist())]
        del free[: int(ends[-1])]
        return cls(rows, np.asarray(lengths, dtype=np.int64).copy(), free, block_size)

    def release(self) -> list:
        """Its pages, given up (their entries read): the rows emptied -> the pages."""
        pages = [p for row in self.rows for p in row]
        self.rows = [[] for _ in self.rows]
        self.lengths = np.zeros_like(self.lengths)
        return pages

    def slots(self, head: int, first: int, count: int) -> np.ndarray:
        """Slots of head ``head``'s entries ``first`` .. ``first + count - 1`` (held pages only)."""
        j = np.arange(first, first + count)
        return np.asarray(self.rows[head], dtype=np.int64)[j // self.block_size] * self.block_size + j % self.block_size

    def append(self, count: int) -> np.ndarray:
        """Make room for ``count`` more entries in every head -> their slots [Hkv, count], new
        pages taken from ``free``; raises if the request's blocks run out. (Plain integers: it runs
        for every layer of every request each step.)"""
        bs, out = self.block_size, []
        for h, (row, n) in enumerate(zip(self.rows, self.lengths.tolist())):
            need = -(-(n + count) // bs) - len(row)
            if need > len(self.free):
                raise RuntimeError(
                    f"restkv.vllm: head {h} needs {need} more pages, {len(self.free)} free in the request's blocks"
                )
            if need > 0:
                row += self.free[:need]
                del self.free[:need]
            out.append([row[j // bs] * bs + j % bs for j in range(n, n + count)])
        self.lengths += count
        return np.asarray(out, dtype=np.int64).reshape(len(self.rows), count)

    def width(self) -> int:
        """The longest head's entries."""
        return int(self.lengths.max())

    def layout(self, window: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The heads' entries as the scorer lays them out while decoding (``restkv.eviction.reselect.relayout``)
        -> slots [Hkv, W] and held [Hkv, W] (W ``width``, at least the longest head's entries, its default):
        each head's older entries first, its newest ``window`` in the last slots, a shorter head's gap between
        (slot of its first entry, not held)."""
        width = self.width() if width is None else width
        slots = np.zeros((len(self.rows), width), dtype=np.int64)
        held = np.zeros((len(self.rows), width), dtype=bool)
        for h, n in enumerate(self.lengths.tolist()):
            entries = self.slots(h, 0, n)
            newest = min(n, window)
            slots[h] = entries[0]
            slots[h, : n - newest], held[h, : n - newest] = entries[: n - newest], True
            slots[h, width - newest :], held[h, width - newest :] = entries[n - newest :], True
        return slots, held


@dataclass
class FlatBatch:
    """A step's batch as single-head sequences, (KV head, request) in head-major order: sequence
    ``h * R + r`` is request r's head h.

    ``query_start_loc`` [Hkv R + 1] where each sequence's queries start in the flattened queries,
    ``seq_lens`` [Hkv R] its entries (the step's included), ``block_table`` [Hkv R, pages] its pages,
    ``slot_mapping`` [Hkv T] where the step's keys and values go (token-major within a head, as
    ``flatten`` orders them); ``query_start_loc_cpu``, ``max_query_len``, ``max_seq_len`` on the
    host, as a backend's metadata builder reads them.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor | None = None
    max_query_len: int = 0
    max_seq_len: int = 0

    @classmethod
    def layers(cls, pages: dict, counts, device, appended: dict) -> dict:
        """Every layer's ``FlatBatch`` of a step, built at once: ``pages`` layer name -> each request's
        ``HeadPages`` after its step's tokens were appended, ``counts`` [R] its tokens in the step,
        ``appended`` layer name -> what each ``append`` returned (their slots [Hkv, count]). The query
        offsets are every layer's (one tensor); the lengths, page tables and slots are one array each,
        copied to the device once, a layer's batch holding views of its rows."""
        names = list(pages)
        counts = np.asarray(counts, dtype=np.int64)
        heads, total, requests = len(pages[names[0]][0].rows), int(counts.sum()), len(counts)
        starts = np.concatenate([[0], np.cumsum(counts)])
        loc = np.append((np.arange(heads)[:, None] * total + starts[None, :-1]).reshape(-1), heads * total)
        lens = np.stack([np.stack([p.lengths for p in pages[n]], 1).reshape(-1) for n in names])  # [L, Hkv R]
        width = max(len(row) for n in names for p in pages[n] for row in p.rows)
        table = np.zeros((len(names), heads, requests, width), dtype=np.int64)
        for i, n in enumerate(names):
            for r, p in enumerate(pages[n]):
                for h, row in enumerate(p.rows):
                    table[i, h, r, : len(row)] = row
        # [Hkv, T] per layer -> head-major, token-major within
        slots = np.stack([np.concatenate(appended[n], axis=1).reshape(-1) for n in names])
        # the backend's int32 arrays in one copy, the slots (an index into every layer's pages) in another
        loc_d, lens_d, table_d = stage([loc, lens.reshape(-1), table.reshape(-1)], device, torch.int32)
        (slots_d,) = stage([slots.reshape(-1)], device)
        lens_d, slots_d = lens_d.view(lens.shape), slots_d.view(slots.shape)
        table_d = table_d.view(len(names), heads * requests, width)
        loc_cpu, most = torch.from_numpy(loc).int(), lens.max(1).tolist()
        return {
            n: cls(loc_d, lens_d[i], table_d[i], slots_d[i], loc_cpu, int(counts.max()), most[i])
            for i, n in enumerate(names)
        }


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def stage(arrays: list, device, dtype=torch.int64) -> list:
    """``arrays`` (host integer arrays, 1-D) on ``device`` as ``dtype``, with one host-to-device copy that does
    not wait for the device: on CUDA from pinned memory of torch's caching host allocator, which reuses a
    buffer only once the copy that read it has run (one buffer of one's own, rewritten by the next call
    while the device may not have read it yet, would race; a copy from pageable memory waits for the
    device)."""
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    host = torch.from_numpy(flat.astype(_NUMPY[dtype]))
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True)
    return list(torch.split(moved, [len(a) for a in arrays]))


def flat_rows(tokens: np.ndarray, kv_heads: int) -> list:
    """Each flattened row's token and KV head, [Hkv n] each, head-major as ``FlatBatch`` orders its
    sequences: row ``h n + i`` is token ``tokens[i]``'s head h (what ``flatten`` and ``unflatten`` index)."""
    return [np.tile(tokens, kv_heads), np.repeat(np.arange(kv_heads), len(tokens))]


def flatten(x: torch.Tensor, rows: tuple, kv_heads: int) -> torch.Tensor:
    """[T, Hq, d] (queries or an output; keys and values [T, Hkv, d]) -> [Hkv n, G, d] (G = 1 for keys
    and values): rows ``rows`` (``flat_rows`` on x's device), one gather whatever x's strides."""
    return x.unflatten(1, (kv_heads, -1))[rows]


def unflatten(out: torch.Tensor, rows: tuple, kv_heads: int, x: torch.Tensor) -> None:
    """Write ``x`` [Hkv n, G, d] into rows ``rows`` of ``out`` [T, Hq, d] or [T, Hq d] (contiguous):
    the inverse of ``flatten``, one scatter."""
    out.view(out.shape[0], kv_heads, -1).index_put_(rows, x.flatten(1).to(out.dtype))
