"""The scheduler's side (engine core process): hits, allocations and the blocks given back, each
request by the config it runs (``Blocks.config``: its own knobs over the engine's, ``per_request``; none:
it passes through).

- ``Scheduler.__init__``: the scheduler's ``Blocks`` (offsets, the step's evictions).
- ``KVCacheManager.get_computed_blocks``: a prefix-cache hit stops where the queries an eviction
  reads begin (``settings.hit_limit``).
- ``KVCacheManager.allocate_slots``: whether the request evicts at the end of this step
  (``settings.eviction``); the evicted group's ``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` /
  ``allocate_new_blocks`` then count the entries it holds, plus the fresh blocks of a first
  eviction under prefix caching (``held_counts``; a hybrid model's sliding-window groups count their own); ``cache_blocks`` leaves an ``settings.uncached``
  request's blocks uncached; ``free`` / ``pop_blocks_for_free`` forget it.
- ``Scheduler.update_from_output``: after the step, the blocks past the kept ones go back to the
  pool (``restkv.vllm.hooks.step_output``).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

from .. import per_request, settings
from .refusals import cache_groups, check_config, evicted_group, pool
from .requests import engine

STATS_KEY = "restkv"  # the plugin's entry in the stats sent to the front end (``metrics``)
COUNTS = ("evictions", "evicted_tokens", "freed_blocks", "eviction_seconds", "failed_requests")


@dataclass
class Blocks:
    """Entries each request evicted, and the evictions of the step scheduled."""

    cfg: object  # the engine's config
    caching: bool
    block_size: int
    engine: per_request.Engine | None = None  # what a request's own knobs are resolved against
    group: int = 0  # the KV cache group evicted (``refusals.evicted_group``); the others are sliding windows
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
    (``refusals.cache_groups``), or a pool too small for one request of ``max_model_len``
    (``refusals.pool``), is refused here, before any request."""

    @functools.wraps(orig)
    def init(self, vllm_config, kv_cache_config, *args, **kwargs):
        orig(self, vllm_config, kv_cache_config, *args, **kwargs)
        cfg = check_config(vllm_config)
        manager = self.kv_cache_manager
        refused = [] if cfg is None else cache_groups(kv_cache_config)
        if cfg is not None and not refused:
            refused = pool(vllm_config, kv_cache_config, cfg, manager.coordinator.block_pool.get_num_free_blocks())
        if refused:
            raise ValueError("\n".join(refused))
        block_size = vllm_config.cache_config.block_size
        state = None
        if cfg is not None:
            group = evicted_group(kv_cache_config)
            state = Blocks(cfg, bool(manager.enable_caching), block_size, engine(vllm_config, cfg), group)
            manager.coordinator.single_type_managers[group]._restkv = state  # its counts: ``held_counts``
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
    """``KVCacheManager.get_computed_blocks``: a hit past ``settings.hit_limit`` is searched again up to
    it (a sliding window's blocks before the hit are vLLM's null block unless it searched for that end)."""

    @functools.wraps(orig)
    def wrapped(self, request, *args, **kwargs):
        blocks, hit, *rest = orig(self, request, *args, **kwargs)
        state = getattr(self, "_restkv", None)
        cfg = None if state is None or hit == 0 else state.config(request)
        if cfg is None:
            return (blocks, hit, *rest)
        limit = settings.hit_limit(cfg, min(request.num_tokens, request.num_prompt_tokens))
        if hit > limit:  # vLLM's search again, up to the limit: every group's hit ends there, a window's whole
            computed, hit, _ = self.coordinator.find_longest_cache_hit(request.block_hashes, limit)
            blocks = self.create_kv_cache_blocks(computed)
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


def held_counts(held: tuple, slots: tuple):
    """A function of the evicted group's manager (``SingleTypeKVCacheManager``: the one ``scheduler_init``
    gave the ``Blocks``) whose token counts ``held`` become the entries a request holds and ``slots`` the
    slots it needs: ``get_num_blocks_to_allocate``, ``allocate_new_blocks``. A sliding-window group's
    manager counts logical tokens, as vLLM's own."""

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


get_num_blocks_to_allocate = held_counts(
    held=("total_computed_tokens", "num_local_computed_tokens"),
    slots=("num_tokens", "num_tokens_main_model"),
)
allocate_new_blocks = held_counts(held=(), slots=("num_tokens", "num_tokens_main_model"))


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
