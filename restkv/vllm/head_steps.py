"""A worker's per-head and per-layer budgets (``settings.per_head``; ``HeadSteps``, a part of
``restkv.vllm.worker.Worker``): an eviction places each head's kept entries on single-head pages of its own
(``restkv.vllm.heads``); from the next step on, the request's tokens are written to its heads' pages and
attended through the layer's backend over the flattened batch (``attend_heads``), vLLM's own write masked
and its output for them replaced; an eviction while decoding reads them back laid out as
``restkv.configure`` lays out heads of different lengths (``HeadPages.layout``). No vLLM import here.
"""

from __future__ import annotations

import numpy as np
import torch

from .heads import FlatBatch, HeadPages, exact_length, flat_rows, flatten, settle, stage, unflatten
from .state import Scheduled


class HeadSteps:
    """The ``Worker``'s part that keeps heads on pages of their own (its state: ``restkv.vllm.worker.Worker``)."""

    def _pool(self, s: Scheduled) -> None:
        """Per-head budgets, an evicting request: the pages of the blocks it keeps (``kept_pages``) and the
        free pages its layers place their kept entries on (``_place``): a first eviction under prefix caching
        the fresh blocks' (its held blocks stay whole), one in its own blocks those holding no entry yet;
        each layer adds its own once it has read them."""
        e, state = s.eviction, s.state
        first = e.first_kept_block
        s.kept_pages = self.space.pages(s.blocks[first : first + e.kept_blocks])
        if e.fresh:
            state.free = list(s.kept_pages)
        elif not state.pages:
            state.free = self.space.pages(s.blocks[e.held_blocks :])

    def _flatten(self, device) -> None:
        """The step's requests whose heads hold their own pages: their new blocks' pages, room for
        their tokens in every layer, each layer's ``FlatBatch``, their tokens (``flat_tokens``) and the
        (token, KV head) of each flattened row (``flat_rows``)."""
        flat = [s for s in self.step if s.state.pages]
        self.flat, self.flat_tokens, self.flat_rows = {}, None, ()
        if not flat:
            return
        appended: dict = {}  # layer name -> each request's new slots [Hkv, count]
        for s in flat:
            s.state.free += self.space.pages(s.blocks[s.state.placed :])
            s.state.placed = len(s.blocks)
            for name, pages in s.state.pages.items():
                appended.setdefault(name, []).append(pages.append(s.count))
        pages = {name: [s.state.pages[name] for s in flat] for name in flat[0].state.pages}
        self.flat = FlatBatch.layers(pages, [s.count for s in flat], device, appended)
        tokens = np.concatenate([np.arange(s.start, s.start + s.count) for s in flat])
        heads = len(next(iter(pages.values()))[0].rows)  # KV heads
        *rows, self.flat_tokens = stage([*flat_rows(tokens, heads), tokens], device)
        self.flat_rows = tuple(rows)

    def attend_heads(self, name, query, key, value, output, paged) -> None:
        """The requests whose heads hold their own pages: their step's keys and values written to their
        heads' pages by the layer's backend (``hooks.attention.single_head``), and their rows of ``output``
        from it over the flattened batch (its G query heads on one KV head per sequence; vLLM's own write
        of their tokens was masked, its output for them is replaced)."""
        rows, heads = self.flat_rows, key.shape[1]
        keys, values = flatten(key, rows, heads)[:, 0], flatten(value, rows, heads)[:, 0]  # [Hkv T, d]
        out = self.attends[name](flatten(query, rows, heads), self.flat[name], self.whole.cache, keys, values)
        unflatten(output, rows, heads, out)

    def _place(self, name, s: Scheduled, kept, paged) -> None:
        """Per-head budgets: each head's kept entries on pages of its own (``HeadPages.placed``; one host
        read of the heads' counts, at the eviction only), from the request's free pages once the layer's
        own are among them (read: its pages, or in its first eviction in its own blocks its part of
        them), those of the blocks it keeps first; ``_settle`` moves the others in at the step's end. The
        entries are moved as stored (``_stored``), never written again from what scoring read."""
        e, state = s.eviction, s.state
        own = state.pages.pop(name, None)
        held = e.held * kept.keys.shape[1] if own is None else int(own.lengths.sum())
        if own is not None:
            state.free += own.release()
        elif not e.fresh:
            state.free += self.space.pages(s.blocks[: e.held_blocks], [name])
        inside = set(s.kept_pages)
        state.free.sort(key=lambda p: p not in inside)
        valid = kept.valid[0] if kept.valid.dim() == 3 else kept.valid.expand(kept.keys.shape[1], -1)
        lengths = valid.sum(-1).tolist()
        s.dropped += max(0, held - sum(lengths))
        pages = HeadPages.placed(state.free, lengths, self.block_size)
        slots = np.concatenate([pages.slots(h, 0, n) for h, n in enumerate(lengths)])
        stored = self._stored(name, s, kept.positions[0], valid, paged)  # read before any page is written
        self.whole.write_pages(torch.from_numpy(slots).to(kept.keys.device), *stored)
        state.pages[name] = pages

    def _stored(self, name, s: Scheduled, positions, valid, paged) -> tuple:
        """The kept entries (``positions`` [Hkv, B] of the observation, where ``valid``) as stored -> keys,
        values [n, d], head by head: from the heads' pages the observation read (``read_from``), or from
        the blocks the request held (``Paged.stored``)."""
        read_from = s.read_from.get(name)
        if read_from is None:
            heads = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
            return paged.stored_at(s.held_slots[positions[valid]], heads[valid])
        return self.whole.read_pages(read_from.gather(1, positions.clamp(min=0))[valid])  # -1: no entry

    def _measure_kept(self, s: Scheduled, lengths: np.ndarray) -> None:
        """Per-head budgets: the request's kept count from its heads' lengths [layers, Hkv] (every layer's,
        ``heads.exact_length``), for the scheduler (``report``), and the pages of the blocks that count keeps
        (``kept_pages``). Under tensor parallelism each rank holds other heads and all must count alike: the
        largest rank's count (``ranks``; the config's bound where no collective is given)."""
        exact = lengths.size == len(self.space.first) * self.space.heads
        exact = exact and (self.tensor_parallel == 1 or self.ranks is not None)
        length = exact_length(lengths, self.block_size) if exact else s.eviction.room
        if self.ranks is not None:
            (length,) = self.ranks.most([length])
        e = s.eviction = s.eviction.kept(length)
        s.kept_pages = self.space.pages(s.blocks[e.first_kept_block : e.first_kept_block + e.kept_blocks])

    def _settle(self, s: Scheduled) -> None:
        """Per-head budgets, after every layer's eviction: the pages outside the blocks the request keeps
        copied into free pages inside them (``heads.settle``), so the scheduler can give the others back."""
        moved_from, moved_to, s.state.free = settle(list(s.state.pages.values()), s.kept_pages)
        if len(moved_from):
            j = np.arange(self.block_size)
            slots = [(p[:, None] * self.block_size + j).reshape(-1) for p in (moved_from, moved_to)]
            source, target = stage(slots, self.whole.cache.device)
            self.whole.write_pages(target, *self.whole.read_pages(source))
