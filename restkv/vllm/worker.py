"""A worker's eviction state and its steps (no vLLM import: ``restkv.vllm.hooks`` feeds it vLLM's
tensors and block tables).

Each engine step the model runner describes its batch (``Worker.begin``): per request its tokens in
the step, the tokens computed before, its prompt length and its blocks; a new request's config comes
with it (``admit``: its own knobs over the engine's, ``restkv.vllm.per_request``), and each request is
scored, kept and counted by its own. The rule of
``restkv.vllm.settings.eviction`` says which requests evict at the end of the step. Then every
attention layer, after its attention, calls ``Worker.layer``: the step's queries go to the query
ring (``restkv.vllm.ring``); a ``SUMMED`` method's prompt chunk adds its scores; each evicting request
reads the entries it holds back from the layer's paged cache (``restkv.vllm.paged``), selects, and
writes the kept entries to the blocks the rule names (``restkv.vllm.layer_eviction``). ``Worker.end``
records the new offsets and returns the block-table edits for the next step.

Per-head and per-layer budgets (``settings.per_head``): each head's kept entries on single-head pages of
its own (``restkv.vllm.head_steps``). A budget shared across layers (``settings.deferred``): each layer
leaves its scores, and ``end`` selects once every layer has run, its kept count sent to the scheduler
with the step's output (``report``). A request's state and its part of a step: ``restkv.vllm.state``.

Memory (``restkv.vllm.memory`` counts it, term by term): per layer, the ring's ``query_rows`` queries
[rows, Hq, d] for every request slot, allocated on the layer's first step; an eviction's own
(``restkv.vllm.layer_eviction``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from . import per_request, settings
from .head_steps import HeadSteps
from .heads import stage
from .layer_eviction import LayerEviction
from .outcome import Kept, Outcome, merged, why
from .ring import QueryRing
from .state import RequestState, Scheduled


class Worker(LayerEviction, HeadSteps):
    """One model runner's eviction state (``cfg`` the engine's config, ``slots`` its most
    requests at once, ``caching`` vLLM's prefix caching, ``block_size`` its blocks' tokens,
    ``engine`` what a request's own knobs resolve against: ``per_request``)."""

    def __init__(self, cfg, slots: int, caching: bool, block_size: int, engine=None):
        self.cfg = cfg
        self.engine = engine
        self.tensor_parallel = 1 if engine is None else engine.tensor_parallel  # ranks, each with some heads
        self.ranks = None  # ``ranks.Ranks``: their collectives, under tensor parallelism (set by the hooks)
        self.configs: dict = {}  # request id -> the config it runs (``admit``), until it finishes
        self.caching = caching
        self.block_size = block_size
        self.ring = QueryRing(settings.query_rows(cfg), slots)
        self.free_slots = list(range(slots - 1, -1, -1))
        self.requests: dict = {}  # request id -> RequestState
        self.step: list = []  # Scheduled, this step's
        self.ring_tokens = self.ring_index = None
        # the step's offsets (logical - held, as the backend's kernel reads them): per request on the host,
        # per token and per request on the device
        self.request_offsets = np.zeros(0, dtype=np.int64)
        self.token_offsets_device = self.request_offsets_device = None
        self.o_proj: dict = {}  # attention layer name -> a function returning its W_O [hidden, Hq d]
        self.factors: dict = {}  # attention layer name -> its W_O factor R [Hq, d, d]
        self.layer_index: dict = {}  # attention layer name -> its index among the model's attention layers
        self.layers = 1  # the model's attention layers (a pipeline stage holds some: ``index_layers``)
        self.relayed = None  # the earlier pipeline stages' outcome of the step (``outcome.KEY``), or None
        # called with (request id, layer name, kept positions [Hkv, B]) at a request's first eviction in a
        # layer, where a check installs one (benchmarks/vllm_check.py); None: nothing is kept
        self.observer = None
        self.blocks: dict = {}  # request id -> its block ids (the scheduler's, as the steps give them)
        self.group = 0  # the KV cache group it evicts (a hybrid model's sliding windows are vLLM's: ``leave``)
        self.pending: dict = {}  # request id -> its last step's Eviction: its blocks to cut before the next step
        self.held_lengths = None  # the step's sequence lengths of the entries held, where a runner needs them
        self.backends: dict = {}  # attention layer name -> its backend's name (for errors)
        self.done: set = set()  # the layers whose attention called ``layer`` in this step
        # per-head budgets (``restkv.vllm.heads``): attention layer name -> a function attending a
        # ``FlatBatch`` through the layer's backend (set by the hooks); the step's flattened batch per
        # layer, and its tokens [m] on the device (those of the requests whose heads hold their own pages)
        self.attends: dict = {}
        self.space = None  # ``heads.Space``: where every layer's pages are in ``whole``
        self.whole = None  # ``paged.Paged`` of every layer's cache as one tensor of blocks (``paged.whole``)
        self.flat: dict = {}
        self.flat_tokens = None
        self.flat_rows: tuple = ()  # [Hkv m] each: every flattened row's token and KV head (``_flatten``)
        # ``settings.deferred``: the step's layers to select in once all have run (name -> (paged, scale,
        # softcap))
        self.later: dict = {}
        # the step's evictions as they ran (``restkv.vllm.outcome``): request id -> why its eviction failed
        # (the request is skipped from there on), and a failure that is not one request's
        self.failed: dict = {}
        self.fault: str | None = None
        self.outcome = Outcome()  # every step's since the last report, for the scheduler (``report``)
        self.evicts = False  # the step has evictions or chunk scores

    # ---- requests ----

    def admit(self, req_id: str, extra_args) -> None:
        """A new request: the config it runs, its own knobs in ``extra_args`` over the engine's
        (``per_request.resolve``, as the front end and the scheduler resolve them)."""
        knobs = per_request.knobs_of(extra_args)
        self.configs[req_id] = self.cfg if knobs is None else per_request.resolve(self.engine, knobs)

    def finish(self, req_ids) -> None:
        """Finished or aborted requests: their configs go (a preempted one keeps its own)."""
        for req_id in req_ids:
            self.configs.pop(req_id, None)

    def forget(self, req_ids) -> None:
        """Finished, aborted, preempted or resumed requests: their state, blocks and ring slot go."""
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_slots.append(state.slot)
            self.blocks.pop(req_id, None)
            self.pending.pop(req_id, None)

    def cut(self, req_id: str):
        """Cut the request's blocks to those its last eviction kept -> that ``settings.Eviction``, or
        None."""
        e = self.pending.pop(req_id, None)
        if e is not None:
            e.cut(self.blocks[req_id])
        return e

    def offsets(self, req_ids) -> np.ndarray:
        """Entries evicted by each request (logical positions - held entries)."""
        return np.array(
            [self.requests[r].offset if r in self.requests else 0 for r in req_ids], dtype=np.int64
        )

    # ---- a step ----

    def begin(self, req_ids, computed, counts, prompt_lens, device) -> None:
        """The step's batch, in its order: per request its id, tokens computed before, tokens in the
        step and prompt length (its blocks: ``blocks``). The host's part of the step (slots, ring
        rows) goes to ``device`` in one copy."""
        self.step = []
        self.flat, self.flat_tokens, self.flat_rows = {}, None, ()
        start = 0
        host = []  # arrays for the device: ring tokens, ring rows, offsets per token and per request, slots
        rows = self.ring.rows
        tokens, index = [], []
        for req_id, c, n, length in zip(req_ids, computed, counts, prompt_lens):
            c, n, length = int(c), int(n), int(length)
            row = np.asarray(self.blocks[req_id], dtype=np.int64)
            state = self.requests.get(req_id)
            if state is None:
                cfg = self.configs.get(req_id, self.cfg)
                state = self.requests[req_id] = RequestState(self.free_slots.pop(), cfg)
                self.ring.slots = max(self.ring.slots, state.slot + 1)
            s = self._scheduled(req_id, state, start, n, c, length, row)
            eviction, sums = s.eviction, s.sums
            self.step.append(s)
            last = min(n, rows)
            tokens.append(np.arange(start + n - last, start + n))
            index.append(state.slot * rows + np.arange(c + n - last, c + n) % rows)
            if sums or eviction is not None:
                host.append(self._slots(row, 0, s.end - state.offset))
                if eviction is not None and not settings.per_head(state.cfg):  # else on its heads' pages
                    host.append(
                        self._slots(
                            row, eviction.first_kept_block * self.block_size, eviction.budget
                        )
                    )
            start += n
        # the backend's own kernel sees a request whose heads hold their own pages as its step's
        # tokens only (its output for them is replaced, its write masked: ``attend_heads``)
        self.request_offsets = np.array(
            [s.computed if s.state.pages else s.state.offset for s in self.step], dtype=np.int64
        )
        per_token = np.repeat(self.request_offsets, [s.count for s in self.step])
        arrays = [np.concatenate(tokens), np.concatenate(index), per_token, self.request_offsets, *host]
        staged = stage(arrays, device)
        self.ring_tokens, self.ring_index, self.token_offsets_device, self.request_offsets_device = staged[:4]
        rest = iter(staged[4:])
        for s in self.step:
            if s.sums or s.eviction is not None:
                s.held_slots = next(rest)
                uniform = s.eviction is not None and not settings.per_head(s.cfg)
                s.kept_slots = next(rest) if uniform else None
        self._flatten(device)
        self.evicts = self.evicting()

    def _scheduled(self, req_id, state, start, count, computed, prompt_len, blocks) -> Scheduled:
        """One request's part of the step: whether it evicts at the step's end (``settings.eviction``) and
        adds chunk scores. A request whose rule raises does neither and fails (``failed``)."""
        s = Scheduled(req_id, state, start, count, computed, prompt_len, blocks, None, False)
        cfg = state.cfg
        if cfg is None:
            return s
        try:
            s.eviction = settings.eviction(
                cfg, computed, count, prompt_len, state.offset, self.caching, self.block_size, state.evicted
            )
            s.sums = settings.summed(cfg) and computed < prompt_len and settings.prompt_evicts(cfg, prompt_len)
            if s.eviction is not None and settings.per_head(cfg):
                self._pool(s)
        except Exception as e:  # noqa: BLE001 (contained to this request: ``failed``)
            self.failed[req_id] = why(e, "its eviction's rule")
            s.eviction, s.sums = None, False
        return s

    def _slots(self, blocks: np.ndarray, first: int, count: int) -> np.ndarray:
        """The slots of entries ``first`` .. ``first + count - 1`` of a request with ``blocks``."""
        j = np.arange(first, first + count)
        return blocks[j // self.block_size].astype(np.int64) * self.block_size + j % self.block_size

    def evicting(self) -> bool:
        return any(s.eviction is not None or s.sums for s in self.step)

    def _working(self, s: Scheduled) -> bool:
        """Whether request ``s`` has eviction work in this step (not once it failed)."""
        return (s.sums or s.eviction is not None) and s.req_id not in self.failed

    def layer(
        self, name: str, query: torch.Tensor, paged, scale: float, softcap, key=None, value=None, output=None
    ) -> None:
        """After layer ``name``'s attention: the attention of the requests whose heads hold their own
        pages (``attend_heads``: ``key``, ``value`` [T, Hkv, d] the step's, ``output`` [T, Hq d] the
        backend's), its queries [T, Hq, d] of the step to the ring, then each request's summed chunk
        scores and evictions, on ``paged`` (``restkv.vllm.paged.Paged``)."""
        self.done.add(name)
        try:
            if self.flat_tokens is not None:
                self.attend_heads(name, query, key, value, output, paged)
            self.ring.write(name, query, self.ring_tokens, self.ring_index)
        except Exception as e:  # noqa: BLE001 (every rank reaches the step's end: ``end`` stops the engine)
            self.fault = self.fault or f"restkv.vllm: {why(e, f'layer {name}')}; stopping before blocks are freed"
        if not self.evicts:
            return
        for s in filter(self._working, self.step):
            start = time.perf_counter()
            try:
                self._request_layer(name, s, query, paged, scale, softcap)
            except Exception as e:  # noqa: BLE001 (contained to this request: ``failed``)
                self.failed[s.req_id] = why(e, f"{s.cfg.method} in layer {name}")
            self._spent(s, start)

    def _request_layer(self, name, s: Scheduled, query, paged, scale, softcap) -> None:
        """Request ``s``'s work in layer ``name``: its chunk scores, then its eviction (or a deferred one's
        scores)."""
        if s.sums:
            self._add_chunk(name, s, query, paged, scale, softcap)
        if s.eviction is not None and settings.deferred(s.cfg):
            self._score(name, s, paged, scale, softcap)
        elif s.eviction is not None:
            self._evict(name, s, paged, scale, softcap)

    def _spent(self, s: Scheduled, start: float) -> None:
        """Host time since ``start`` on request ``s``, counted to its method."""
        seconds = self.outcome.seconds
        seconds[s.cfg.method] = seconds.get(s.cfg.method, 0.0) + time.perf_counter() - start


    def end(self, scheduled: int | None = None) -> None:
        """After the step: each evicting request's new offset, its blocks to cut before the next step
        (``pending``, ``cut``) and its ``outcome.Kept`` for the scheduler; a request whose eviction failed
        is left as it was and reported failed (the scheduler finishes it with an error). Under tensor
        parallelism every rank's outcome is gathered first (``outcome.merged``). A step the plugin did
        not see whole raises instead, since the scheduler would free blocks still read: ``scheduled``
        tokens ran without ``begin``, or an attention layer did not call ``layer`` (its queries not in
        the ring, its eviction not run); so does a fault on any rank."""
        if scheduled and not self.step:
            raise RuntimeError(
                f"restkv.vllm: the model runner ran a step of {scheduled} tokens without the plugin's batch "
                "hook; stopping before its blocks are freed"
            )
        missed = sorted(self.layer_index.keys() - self.done, key=self.layer_index.get) if self.step else []
        self.done = set()
        if missed and not self.fault:
            name = missed[0]
            self.fault = (
                f"restkv.vllm: layer {name} ({self.backends.get(name, 'an unknown backend')}) ran its attention "
                "without the plugin in this step; stopping before its blocks are freed"
            )
        shared = self.ranks is not None and (self.evicts or self.flat_tokens is not None)
        kept = {}
        for s in filter(self._working, self.step):
            start = time.perf_counter()
            try:
                if s.eviction is not None:
                    kept[s.req_id] = self._conclude(s)
            except Exception as e:  # noqa: BLE001 (contained to this request: ``failed``)
                self.failed[s.req_id] = why(e, f"{s.cfg.method} at the step's end")
            self._spent(s, start)
        step = Outcome(kept, self.failed, fault=self.fault)
        step = merged(self.ranks.share(step) if shared else [step])  # raises a fault of any rank
        if self.relayed is not None:  # the earlier stages' (their layers): one outcome of every layer
            earlier, self.relayed = self.relayed, None
            step = merged([earlier, step], "pipeline stage")  # raises an earlier stage's fault
            for method, seconds in earlier.seconds.items():
                self.outcome.seconds[method] = self.outcome.seconds.get(method, 0.0) + seconds
        for s in self.step:
            if s.req_id in step.failed:
                self.pending.pop(s.req_id, None)
            elif s.req_id in step.kept:
                self._advance(s)
            elif s.sums and s.end >= s.prompt_len:
                s.state.sums.clear()
        self.outcome.kept.update(step.kept)
        self.outcome.failed.update(step.failed)
        self.step, self.failed, self.fault = [], {}, None
        self.flat, self.flat_tokens, self.flat_rows = {}, None, ()
        self.later = {}

    def _conclude(self, s: Scheduled) -> Kept:
        """Evicting request ``s`` after every layer ran: a deferred eviction selected (``_finish``), per-head
        budgets counted and their pages settled -> its ``outcome.Kept``."""
        if settings.deferred(s.cfg):
            self._finish(s)
        elif settings.per_head(s.cfg):
            self._measure_kept(s, np.stack([pages.lengths for pages in s.state.pages.values()]))
        if settings.per_head(s.cfg):
            self._settle(s)
        return Kept(s.eviction.held, s.eviction.counted, s.dropped, s.heads)

    def _advance(self, s: Scheduled) -> None:
        """Request ``s`` evicted: its new offset, its blocks to cut before the next step."""
        s.state.offset += s.eviction.evicted
        s.state.evicted = True
        s.state.placed = s.eviction.kept_blocks
        s.state.sums.clear()
        self.pending[s.req_id] = s.eviction

    def report(self) -> Outcome:
        """Every step's outcome since the last report (the evictions and their counts, the failed
        requests, the host seconds spent evicting per method), for the scheduler."""
        out, self.outcome = self.outcome, Outcome()
        return out
