"""Every place restkv touches vLLM: wrappers around private functions of vLLM's V1 engine, each passing
through for an engine without the plugin's config. The table of them, and what the running vLLM has of it,
is ``table`` (``TARGETS``, ``READS``, ``install``, ``unhooked``); the check of a model runner once it exists
is ``coverage`` (``covered``). The wrappers, by what they wrap:

- ``refusals``: what cannot run, all at once, before any engine starts; the knobs carried in the
  engine's config; every worker's plugin checked against the scheduler's once the KV cache exists;
- ``requests``: a request's own knobs checked in the front end (HTTP 400 for a bad one);
- ``scheduler``: prefix-cache hits, block allocation; ``step_output``: the blocks given back after an
  eviction, the counts sent to the front end (``metrics``);
- ``runner`` (what both model runners share), ``runner_v1`` (the CPU backend's), ``runner_v2`` (the
  CUDA default): the step's batch, held positions in the slot mapping and sequence lengths,
  block-table rows cut to the kept blocks;
- ``attention``: the ``forward`` of each backend of ``BACKENDS``, followed by the layer's eviction
  through its own cache layout;
- ``memory``: the KV pool sized without the plugin's own memory.
"""

from __future__ import annotations

from . import (attention, coverage, memory, refusals, requests, runner, runner_v1, runner_v2, scheduler,
               step_output)
from .coverage import metadata_fields
from .table import (
    BACKENDS,
    READS,
    READS_V1,
    TARGETS,
    V1_MODULES,
    absent,
    covered,
    install,
    reading,
    targets,
    unhooked,
    v1_runner,
)

__all__ = [
    "attention", "coverage", "memory", "refusals", "requests", "runner", "runner_v1", "runner_v2", "scheduler",
    "step_output", "BACKENDS", "READS", "READS_V1", "TARGETS", "V1_MODULES", "absent", "covered", "install", "metadata_fields",
    "reading", "targets", "unhooked", "v1_runner",
]
