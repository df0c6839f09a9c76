"""The scheduler's side (engine core process): hits, allocations and the blocks given back, each
request by the config it runs (``Blocks.config``: its own knobs over the engine's, ``per_request``; none:
it passes through).

- ``Scheduler.__init__``: the scheduler's ``Blocks`` (offsets, the step's evictions).
- ``KVCacheManager.get_computed_blocks``: a prefix-cache hit stops where the queries an eviction
  reads begin (``settings.hit_limit``).
- ``KVCacheManager.allocate_slots``: whether the request evicts at the end of this step
  (``settings.eviction``); ``KVCacheCoordinator.get_num_blocks_to_allocate`` /
  ``allocate_new_blocks`` then count the entries it holds, plus the fresh blocks of a first
  eviction under prefix caching; ``cache_blocks`` leaves an ``settings.uncached`` request's blocks
  uncached; ``free`` / ``pop_blocks_for_free`` forget it.
- ``Scheduler.update_from_output``: after the step, the blocks past the kept ones go back to the
  pool (a block other requests share keeps its other references, a cached one its hash: it was not
  written; a ``settings.deferred`` count as the worker measured it, sent with the step's output), and
  an evicted request's blocks are never cached; the plugin's counts go into the stats sent to the
  front end (``send``, ``metrics``); a preempted request that generated
  tokens and evicted, or holds more than the budget (its recomputation evicts), is named in one
  log line: computed again from its tokens, it evicts again at another point, so its tokens from
  there on can differ from a run without preemption (one preempted before is computed again as
  it was).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from .. import per_request, settings
from ..outcome import Outcome
from .refusals import cache_groups, check_config
from .requests import engine

NEVER_CACHED = 1 << 62  # an evicted request's count of cached blocks: none of its blocks is hashed again
STATS_KEY = "restkv"  # the plugin's entry in the stats sent to the front end (``metrics``)
COUNTS = ("evictions", "evicted_tokens", "freed_blocks", "eviction_seconds", "failed_requests")
logger = logging.getLogger("vllm.restkv")  # under vLLM's logger: its handler and level


@dataclass
class Blocks:
    """Entries each request evicted, and the evictions of the step scheduled."""

    cfg: object  # the engine's config
    caching: bool
    block_size: int
    engine: per_request.Engine | None = None  # what a request's own knobs are resolved against
    configs: dict = field(default_factory=dict)  # request id -> the config it runs (None: it keeps all)
    offsets: dict = field(default_factory=dict)  # request id -> logical - held entries
    due: dict = field(default_factory=dict)  # request id -> settings.Eviction, of the step being scheduled
    # id(scheduler output) -> (it, its ``due``), each step's until its output comes back: under pipeline
    # parallelism a request's next prompt chunk is scheduled before its last one's output is back
    sent: dict = field(default_factory=dict)
    freed: dict = field(default_factory=dict)  # request id -> its offset when freed, this step
    counts: dict = field(default_factory=dict)  # method -> {count: value}, since the last stats sent

    def config(self, request):
        """The config ``request`` runs (``per_request.resolve``: its own knobs over the engine's), or None."""
        if request.request_id not in self.configs:
            knobs = per_request.knobs_of(getattr(request.sampling_params, "extra_args", None))
            self.configs[request.request_id] = (
                self.cfg if knobs is None or self.engine is None else per_request.resolve(self.engine, knobs)
            )
        return self.configs[request.request_id]

    def tally(self, method: str) -> dict:
        """The counts of ``method`` since the last stats sent."""
        return self.counts.setdefault(method, dict.fromkeys(COUNTS, 0))

    def held(self, request_id: str, tokens: int) -> int:
        return tokens - self.offsets.get(request_id, 0)

    def slots(self, request_id: str, tokens: int) -> int:
        """Slots a request needs for ``tokens`` logical tokens: the entries it holds, and the
        blocks its eviction in this step writes (``settings.Eviction.slots``)."""
        e = self.due.get(request_id)
        held = self.held(request_id, tokens)
        return held if e is None else max(held, e.slots)

    def evictions(self, scheduler_output) -> dict:
        """request id -> ``settings.Eviction`` of a step scheduled and not yet back (``schedule``)."""
        return self.sent.get(id(scheduler_output), (None, {}))[1]

    def forget(self, request_id: str) -> None:
        self.freed[request_id] = self.offsets.pop(request_id, 0)
        self.due.pop(request_id, None)
        self.configs.pop(request_id, None)


def scheduler_init(orig):
    """The original, then the plugin's ``Blocks`` where it runs; a KV cache of groups it does not evict
    (``refusals.cache_groups``) is refused here, before any request."""

    @functools.wraps(orig)
    def init(self, vllm_config, kv_cache_config, *args, **kwargs):
        orig(self, vllm_config, kv_cache_config, *args, **kwargs)
        cfg = check_config(vllm_config)
        refused = [] if cfg is None else cache_groups(kv_cache_config)
        if refused:
            raise ValueError("\n".join(refused))
        manager = self.kv_cache_manager
        block_size = vllm_config.cache_config.block_size
        state = None if cfg is None else Blocks(cfg, bool(manager.enable_caching), block_size, engine(vllm_config, cfg))
        manager._restkv = manager.coordinator._restkv = state

    return init


def schedule(orig):
    """``Scheduler.schedule``: the evictions its allocations gave (``Blocks.due``) kept with the step
    scheduled, for its output (``update_from_output``), however many steps are in flight."""

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        state = getattr(self.kv_cache_manager, "_restkv", None)
        if state is None:
            return orig(self, *args, **kwargs)
        state.due = {}
        out = orig(self, *args, **kwargs)
        state.sent[id(out)] = (out, state.due)
        state.due = {}
        return out

    return wrapped


def get_computed_blocks(orig):
    @functools.wraps(orig)
    def wrapped(self, request, *args, **kwargs):
        blocks, hit, *rest = orig(self, request, *args, **kwargs)
        state = getattr(self, "_restkv", None)
        cfg = None if state is None or hit == 0 else state.config(request)
        if cfg is None:
            return (blocks, hit, *rest)
        limit = settings.hit_limit(cfg, min(request.num_tokens, request.num_prompt_tokens))
        if hit > limit:
            hit = limit // state.block_size * state.block_size
            blocks = self.truncate_computed_blocks(blocks, hit)
        return (blocks, hit, *rest)

    return wrapped


def allocate_slots(orig):
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapped(self, request, *args, **kwargs):
        state = getattr(self, "_restkv", None)
        cfg = None if state is None else state.config(request)
        if cfg is None and state is not None:
            state.due.pop(request.request_id, None)
        if cfg is not None:
            bound = signature.bind(self, request, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            computed = (
                request.num_computed_tokens
                + a["num_new_computed_tokens"]
                + a["num_external_computed_tokens"]
            )
            e = settings.eviction(
                cfg,
                computed,
                a["num_new_tokens"],
                request.num_prompt_tokens,
                state.offsets.get(request.request_id, 0),
                state.caching,
                state.block_size,
                request.request_id in state.offsets,
            )
            if e is None:
                state.due.pop(request.request_id, None)
            else:
                state.due[request.request_id] = e
        return orig(self, request, *args, **kwargs)

    return wrapped


def counted(held: tuple, slots: tuple):
    """A coordinator function whose token counts ``held`` become the entries a request holds and
    ``slots`` the slots it needs (``Blocks``): ``get_num_blocks_to_allocate``,
    ``allocate_new_blocks``."""

    def wrap(orig):
        signature = inspect.signature(orig)

        @functools.wraps(orig)
        def wrapped(self, *args, **kwargs):
            s = getattr(self, "_restkv", None)
            if s is None:
                return orig(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            a = bound.arguments
            for name in held:
                a[name] = s.held(a["request_id"], a[name])
            for name in slots:
                a[name] = s.slots(a["request_id"], a[name])
            return orig(*bound.args, **bound.kwargs)

        return wrapped

    return wrap


get_num_blocks_to_allocate = counted(
    held=("total_computed_tokens", "num_local_computed_tokens"),
    slots=("num_tokens", "num_tokens_main_model"),
)
allocate_new_blocks = counted(held=(), slots=("num_tokens", "num_tokens_main_model"))


def cache_blocks(orig):
    """``KVCacheCoordinator.cache_blocks``: an ``settings.uncached`` request's blocks are never cached
    (its eviction writes over them)."""

    @functools.wraps(orig)
    def wrapped(self, request, *args, **kwargs):
        s = getattr(self, "_restkv", None)
        cfg = None if s is None else s.config(request)
        if cfg is not None and settings.uncached(cfg, request.num_prompt_tokens):
            return None
        return orig(self, request, *args, **kwargs)

    return wrapped


def forget(orig):
    @functools.wraps(orig)
    def wrapped(self, request_id, *args, **kwargs):
        s = getattr(self, "_restkv", None)
        if s is not None:
            s.forget(request_id)
        return orig(self, request_id, *args, **kwargs)

    return wrapped


def update_from_output(orig):
    """Around the original: first the requests whose eviction failed on a worker are finished with an
    error (``fail``) and every other eviction of the step is checked against the scheduler's own rule
    (``checked``: a count that differs stops the engine before any block is freed); after it, each
    request that evicted keeps its kept blocks only, and a preempted request that will evict at another
    point is logged (``log_preempted``)."""

    @functools.wraps(orig)
    def wrapped(self, scheduler_output, model_runner_output):
        state = getattr(self.kv_cache_manager, "_restkv", None)
        if state is None:
            return orig(self, scheduler_output, model_runner_output)
        outcome = getattr(model_runner_output, "restkv", None) or Outcome()
        due = state.evictions(scheduler_output)
        state.sent.pop(id(scheduler_output), None)
        failed = fail(self, state, outcome.failed)
        evictions = checked(self, due, scheduler_output, outcome)
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        counts = {  # as they were when preempted: this step may resume them
            r: (self.requests[r].num_output_tokens, self.requests[r].num_tokens, state.config(self.requests[r]))
            for r in preempted
            if r in self.requests
        }
        out = orig(self, scheduler_output, model_runner_output)
        for method, seconds in outcome.seconds.items():
            state.tally(method)["eviction_seconds"] += seconds
        for request in failed:
            errored(out, request)
        for req_id, (e, kept) in evictions.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            tally = state.tally(state.config(request).method)
            for manager in self.kv_cache_manager.coordinator.single_type_managers:
                tally["freed_blocks"] += keep_evicted(manager, req_id, e, state.caching)
            state.offsets[req_id] = state.offsets.get(req_id, 0) + e.evicted
            tally["evictions"] += 1
            tally["evicted_tokens"] += kept.evicted
        for req_id, (generated, tokens, cfg) in counts.items():
            log_preempted(state, req_id, generated, tokens, cfg)
        state.freed.clear()
        send(state, out)
        return out

    return wrapped


def fail(scheduler, state: Blocks, failed: dict) -> list:
    """The requests whose eviction failed on a worker (``failed``: request id -> why), finished with an
    error before the step's outputs are made: their blocks go back to the pool whole, their client gets
    vLLM's error for the request, the others go on. Each is logged once and counted -> those finished."""
    live = [r for r in failed if r in scheduler.requests and not scheduler.requests[r].is_finished()]
    for req_id in live:
        method = (state.config(scheduler.requests[req_id]) or state.cfg).method
        state.tally(method)["failed_requests"] += 1
        logger.error(
            "restkv: request %s failed in its eviction, %s; it is finished with an error and its blocks go "
            "back to the pool; the other requests go on",
            req_id,
            failed[req_id],
        )
    return scheduler.finish_requests(live, RequestStatus.FINISHED_ERROR) if live else []


def errored(outputs: dict, request) -> None:
    """The output telling ``request``'s client it finished with an error (as vLLM tells it of its own)."""
    eco = outputs.get(request.client_index)
    if eco is None:
        eco = outputs[request.client_index] = EngineCoreOutputs()
    eco.outputs.append(
        EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason())
    )


def checked(scheduler, due: dict, scheduler_output, outcome: Outcome) -> dict:
    """The step's evictions (``due``: request id -> ``settings.Eviction``, as ``schedule`` kept them),
    each the scheduler's own rule's checked against what
    the workers report (``outcome.Kept``: every rank's agreed, ``outcome.merged``) -> request id -> (the
    eviction, with the worker's count where it is the worker's to measure, and its ``Kept``). An eviction
    the workers did not report, or whose entries held or kept count differ, stops the engine, naming the
    request, before any block is freed; so does an eviction the workers ran and the rule does not give."""
    evictions = {}
    for req_id in scheduler_output.num_scheduled_tokens:
        e = due.get(req_id)
        request = scheduler.requests.get(req_id)
        if e is None or request is None or request.is_finished():
            continue
        kept = outcome.kept.get(req_id)
        if kept is None:
            raise RuntimeError(
                f"restkv.vllm: request {req_id} evicted without its kept count from the worker; "
                "stopping before its blocks are freed"
            )
        if e.measured:
            e = e.kept(kept.counted)
        if (kept.held, kept.counted) != (e.held, e.counted):
            raise RuntimeError(
                f"restkv.vllm: request {req_id}'s eviction on the workers held {kept.held} entries and kept "
                f"{kept.counted}; the scheduler's rule gives {e.held} and {e.counted}: stopping before its blocks "
                "are freed"
            )
        evictions[req_id] = (e, kept)
    for req_id in outcome.kept.keys() - evictions.keys():
        request = scheduler.requests.get(req_id)
        if request is not None and not request.is_finished():
            raise RuntimeError(
                f"restkv.vllm: request {req_id} evicted on the workers where the scheduler's rule gives no "
                "eviction; stopping before its blocks are read again"
            )
    return evictions


def send(state: Blocks, outputs: dict) -> None:
    """The counts since the last stats (per method) into the stats this step sends the front end, if it
    sends any (``kv_connector_stats["restkv"]``, taken out again by ``metrics.StatLogger``)."""
    if not any(any(c.values()) for c in state.counts.values()):
        return
    for eco in outputs.values():
        stats = getattr(eco, "scheduler_stats", None)
        if stats is not None:
            stats.kv_connector_stats = {**(stats.kv_connector_stats or {}), STATS_KEY: state.counts}
            state.counts = {}
            return


def log_preempted(state: Blocks, req_id: str, generated: int, tokens: int, cfg) -> None:
    """One line for a request running ``cfg`` (None: it keeps all) preempted after ``generated``
    tokens (``tokens`` in all) whose recomputation evicts at another point than its run did: it
    evicted, or holds more than the budget. One preempted before its first token is computed again
    as it was (its prompt's eviction at the same point)."""
    evicted = state.freed.get(req_id, 0)
    if cfg is not None and generated and (evicted or tokens > cfg.max_capacity_prompt):
        logger.info(
            "restkv: request %s preempted after %d generated tokens (%d entries evicted): computed "
            "again from its tokens, it evicts again; its later tokens can differ from a run "
            "without preemption",
            req_id,
            generated,
            evicted,
        )


def keep_evicted(manager, req_id: str, e: settings.Eviction, caching: bool) -> int:
    """Keep the request's kept blocks; the others go back to the pool, tail first -> their count."""
    blocks = manager.req_to_blocks.get(req_id)
    if not blocks:
        return 0
    gone = e.cut(blocks)
    if caching:
        manager.num_cached_block[req_id] = NEVER_CACHED
    manager.block_pool.free_blocks(reversed(gone))
    return len(gone)
