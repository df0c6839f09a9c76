"""What the plugin refuses, all at once, before any engine starts (``EngineArgs.create_engine_config``)."""

from __future__ import annotations

import functools
import importlib

from .. import settings

BACKEND_FLAG = (
    "attention_config={'backend': 'FLASH_ATTN'} (vllm serve: --attention-backend FLASH_ATTN), or another "
    "backend the plugin hooks"
)


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
            getattr(parallel, "prefill_context_parallel_size", 1) > 1,
            "prefill context parallelism: prefill_context_parallel_size=1 "
            "(vllm serve: --prefill-context-parallel-size 1)",
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


def unreached(vllm_config, backends) -> list[str]:
    """Why the engine's path would leave the plugin's wrappers: a worker class that overrides
    ``initialize_from_config`` (where the model runner is checked), an attention backend asked for
    that is not one of ``backends``."""
    lines = []
    module, _, name = vllm_config.parallel_config.worker_cls.rpartition(".")
    worker = getattr(importlib.import_module(module), name)
    if not getattr(worker.initialize_from_config, "_restkv", False):
        lines.append(
            f"vLLM's worker {worker.__qualname__} is not one the plugin hooks (vllm.v1.worker.gpu_worker.Worker "
            "and its subclasses that keep its initialize_from_config)"
        )
    chosen = getattr(vllm_config.attention_config, "backend", None)
    if chosen is not None and chosen.name not in backends:
        lines.append(f"attention backend {chosen.name} is not one the plugin hooks ({', '.join(backends)}): {BACKEND_FLAG}")
    return lines


def check_config(vllm_config, unhooked=lambda config: ()):
    """The plugin's config for this engine (None: off); a ValueError, one line per cause, for what
    it cannot run with. ``unhooked(vllm_config)``: what of vLLM the plugin's wrappers do not reach."""
    cfg = settings.from_env(vllm_config.additional_config)
    if cfg is None:
        return None
    lines = refusals(vllm_config, cfg)
    lines += [f"{settings.ENV}: {why}" for why in unhooked(vllm_config)]
    if lines:
        raise ValueError("\n".join(lines))
    bind_model(vllm_config, cfg)
    return cfg


def bind_model(vllm_config, cfg) -> None:
    """``settings.bind_model`` with this engine's model (one rank's heads); a table that does not fit it
    raises a one-line ValueError naming the knob's file."""
    m, p = vllm_config.model_config, vllm_config.parallel_config
    try:
        settings.bind_model(cfg, m.get_num_layers(p), m.get_num_attention_heads(p), m.get_num_kv_heads(p))
    except ValueError as e:
        raise ValueError(f"{settings.ENV}: {e}") from None


def configured(vllm_config) -> bool:
    """Whether the plugin runs in this engine."""
    return settings.from_env(vllm_config.additional_config) is not None


def attention_layers(vllm_config) -> dict:
    """{layer name: attention layer} of the model built under ``vllm_config`` (those with a backend
    ``impl``)."""
    context = vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in context.items() if hasattr(layer, "impl")}


def create_engine_config(orig, unhooked):
    """``EngineArgs.create_engine_config``, then ``check_config`` with ``unhooked``."""

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        check_config(config, unhooked)
        return config

    return wrapped
