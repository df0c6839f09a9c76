"""What the plugin refuses, all at once, before any engine starts (``EngineArgs.create_engine_config``)."""

from __future__ import annotations

import functools

from .. import settings


def refusals(vllm_config, cfg) -> list[str]:
    """One line per cause the plugin cannot run with, naming the ``LLM(...)`` keyword and the
    ``vllm serve`` flag."""
    parallel = vllm_config.parallel_config
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    mixes = settings.mixes_heads(cfg)
    causes = [
        (
            vllm_config.speculative_config is not None,
            "speculative decoding: drop speculative_config= (vllm serve: --speculative-config)",
        ),
        (
            vllm_config.scheduler_config.async_scheduling,
            "asynchronous scheduling allocates a step before the last one's eviction frees blocks: "
            "async_scheduling=False (vllm serve: --no-async-scheduling)",
        ),
        (
            mode is not None and mode.has_full_cudagraphs(),
            f"CUDA graphs of whole steps ({mode.name if mode is not None else ''}) replay attention "
            "without the plugin: compilation_config={'cudagraph_mode': 'PIECEWISE'} "
            "(vllm serve: -cc.cudagraph_mode=PIECEWISE), or enforce_eager=True (--enforce-eager)",
        ),
        (
            vllm_config.model_config.get_sliding_window() is not None,
            f"{vllm_config.model_config.model} has sliding-window attention layers; the plugin "
            "runs full-attention models",
        ),
        (
            parallel.pipeline_parallel_size > 1,
            "pipeline parallelism: pipeline_parallel_size=1 (vllm serve: --pipeline-parallel-size 1)",
        ),
        (
            parallel.tensor_parallel_size > 1 and mixes is not None,
            f"{mixes}, and tensor parallelism gives each rank some heads: tensor_parallel_size=1 "
            "(vllm serve: --tensor-parallel-size 1) or another method",
        ),
        (
            getattr(parallel, "decode_context_parallel_size", 1) > 1,
            "decode context parallelism: decode_context_parallel_size=1 "
            "(vllm serve: --decode-context-parallel-size 1)",
        ),
        (
            vllm_config.cache_config.cache_dtype != "auto",
            "a quantized KV cache: kv_cache_dtype='auto' (vllm serve: --kv-cache-dtype auto)",
        ),
    ]
    return [f"{settings.ENV}: {why}" for refused, why in causes if refused]


def check_config(vllm_config):
    """The plugin's config for this engine (None: off); a ValueError, one line per cause, for what
    it cannot run with."""
    cfg = settings.from_env(vllm_config.additional_config)
    if cfg is None:
        return None
    lines = refusals(vllm_config, cfg)
    if lines:
        raise ValueError("\n".join(lines))
    return cfg


def create_engine_config(orig):
    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        check_config(config)
        return config

    return wrapped
