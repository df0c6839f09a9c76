"""The plugin's figures in vLLM's own metrics: a stat-logger plugin (``vllm.stat_logger_plugins``).

The scheduler counts, per engine, each request's evictions, the positions they drop and the blocks they
give back, and adds the worker's eviction seconds sent with each step's output
(``step_output.update_from_output``); it puts the counts since its last stats into the stats it sends the
front end, under ``kv_connector_stats["restkv"]`` (``COUNTS``), the one free-form field vLLM carries
from the engine to the front end. This logger, which vLLM calls before its own, takes them out again
(so vLLM's loggers see that field as they would without the plugin) and adds them to Prometheus counters
on the server's ``/metrics``, beside vLLM's, labelled by method (each request's, ``per_request``) and
engine:

- ``restkv:evictions_total``: evictions run (a request's eviction at the prompt's end, then at each
  ``decode_interval`` check that found it over its budget);
- ``restkv:evicted_tokens_total``: positions evicted, per KV head and layer (each eviction's entries held
  minus kept, summed over its layers and KV heads as the workers dropped them, over their count);
- ``restkv:freed_blocks_total``: blocks the evictions gave back to the pool;
- ``restkv:eviction_seconds_total``: the worker's time in the evictions (host time: on a GPU, the
  launches);
- ``restkv:failed_requests_total``: requests finished with an error because their eviction raised
  (``restkv.vllm.outcome``; the others go on).

It also writes one line per logging interval (``--disable-log-stats`` off) when the counts moved.
"""

from __future__ import annotations

import logging

from vllm.v1.metrics.loggers import StatLoggerBase

from .. import settings
from .scheduler import COUNTS, STATS_KEY as KEY

logger = logging.getLogger("vllm.restkv")
HELP = {
    "evictions": "evictions run",
    "evicted_tokens": "positions evicted, per KV head and layer",
    "freed_blocks": "KV blocks the evictions gave back to the pool",
    "eviction_seconds": "seconds the worker spent evicting (host time)",
    "failed_requests": "requests finished with an error because their eviction failed",
}
_COUNTERS: dict = {}  # name -> prometheus Counter, one per process (vLLM may build several loggers)


def counters() -> dict:
    from prometheus_client import Counter

    if not _COUNTERS:
        for name in COUNTS:
            _COUNTERS[name] = Counter(f"restkv:{name}", f"restkv: {HELP[name]}", labelnames=["method", "engine"])
    return _COUNTERS


def take(scheduler_stats) -> dict | None:
    """The plugin's counts in ``scheduler_stats`` (removed from it: a ``kv_connector_stats`` left empty
    becomes None again), or None."""
    extra = getattr(scheduler_stats, "kv_connector_stats", None)
    if not extra or KEY not in extra:
        return None
    counts = extra.pop(KEY)
    if not extra:
        scheduler_stats.kv_connector_stats = None
    return counts


class StatLogger(StatLoggerBase):
    """vLLM's stat-logger interface for the plugin's counts (off: it records nothing)."""

    def __init__(self, vllm_config, engine_index: int = 0):
        cfg = settings.from_env(vllm_config.additional_config)
        self.method = None if cfg is None else cfg.method
        self.engine = str(engine_index)
        self.totals = dict.fromkeys(COUNTS, 0)
        self.logged = dict(self.totals)
        self.series = {}  # method -> {count: its series}
        if self.method is not None:  # the engine's method's series shown from the start, at zero
            self.of(self.method)

    def of(self, method: str) -> dict:
        """The series of ``method`` (a request's own method's made at its first count)."""
        if method not in self.series:
            labels = {"method": method, "engine": self.engine}
            self.series[method] = {n: c.labels(**labels) for n, c in counters().items()}
        return self.series[method]

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        counts = take(scheduler_stats) if scheduler_stats is not None else None
        if not counts or self.method is None:
            return
        for method, values in counts.items():
            for name, series in self.of(method).items():
                value = values.get(name, 0)
                if value > 0:  # a counter only grows; one that did not is logged, never raised
                    series.inc(value)
                    self.totals[name] += value
                elif value < 0:
                    logger.warning("restkv: a negative count of %s (%s) left out of /metrics", name, value)

    def log(self):
        if self.totals == self.logged:
            return
        t = self.totals
        logger.info(
            "restkv (engine %s): %d evictions, %.0f positions evicted per head and layer, %d blocks given "
            "back, %.2f s evicting, %d requests failed",
            self.engine, t["evictions"], t["evicted_tokens"], t["freed_blocks"], t["eviction_seconds"],
            t["failed_requests"],
        )  # fmt: skip
        self.logged = dict(t)

    def log_engine_initialized(self):
        pass
