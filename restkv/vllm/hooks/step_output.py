"""The scheduler's side after a step (engine core process): ``Scheduler.update_from_output``, around
vLLM's own. The blocks past the kept ones go back to the pool (a block other requests share keeps its
other references, a cached one its hash: it was not written; a ``settings.deferred`` count as the worker
measured it, sent with the step's output), and an evicted request's blocks are never cached; a request
whose eviction failed on a worker is finished with an error (``fail``), and every other eviction is
checked against the scheduler's own rule first (``checked``); the plugin's counts go into the stats sent
to the front end (``send``, ``metrics``); a preempted request that generated tokens and evicted, or holds
more than the budget (its recomputation evicts), is named in one log line: computed again from its
tokens, it evicts again at another point, so its tokens from there on can differ from a run without
preemption (one preempted before is computed again as it was).
"""

from __future__ import annotations

import functools
import logging

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from .. import settings
from ..outcome import Outcome
from .scheduler import STATS_KEY, Blocks

NEVER_CACHED = 1 << 62  # an evicted request's count of cached blocks: none of its blocks is hashed again
logger = logging.getLogger("vllm.restkv")  # under vLLM's logger: its handler and level


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
            manager = self.kv_cache_manager.coordinator.single_type_managers[state.group]
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
