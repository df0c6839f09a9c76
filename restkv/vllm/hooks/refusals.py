"""What the plugin refuses, all at once, before any engine starts (``EngineArgs.create_engine_config``)."""

from __future__ import annotations

import functools
import importlib
import json
import os

from .. import paged, settings

BACKEND_FLAG = (
    "attention_config={'backend': 'FLASH_ATTN'} (vllm serve: --attention-backend FLASH_ATTN), or another "
    "backend the plugin hooks"
)

FP8_FLAG = "kv_cache_dtype='auto' or 'fp8' (vllm serve: --kv-cache-dtype auto, or fp8, fp8_e4m3, fp8_e5m2)"

HEAD_BACKEND_FLAG = (
    "attention_config={'backend': 'TRITON_ATTN'} (vllm serve: --attention-backend TRITON_ATTN) with "
    "VLLM_KV_CACHE_LAYOUT=HND"
)


def refusals(vllm_config, cfg) -> list[str]:
    """One line per cause the plugin cannot run with, naming the ``LLM(...)`` keyword and the
    ``vllm serve`` flag."""
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    mixes = settings.mixes_heads(cfg)
    slides = model.get_sliding_window() is not None
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
            slides and getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", False),
            f"{model.model} has sliding-window layers, and disable_hybrid_kv_cache_manager=True puts them in "
            "the full-attention layers' group of blocks, which the plugin cuts: drop it "
            "(vllm serve: drop --disable-hybrid-kv-cache-manager)",
        ),
        (
            parallel.pipeline_parallel_size > 1 and settings.per_head(cfg),
            f"{settings.budget_knobs(cfg)} under pipeline parallelism (each stage's heads and layers would keep "
            "their own counts of the blocks every stage shares): pipeline_parallel_size=1 "
            "(vllm serve: --pipeline-parallel-size 1) or uniform budgets",
        ),
        (
            parallel.tensor_parallel_size > 1 and mixes is not None,
            f"{mixes}, and tensor parallelism gives each rank some heads: tensor_parallel_size=1 "
            "(vllm serve: --tensor-parallel-size 1) or another method",
        ),
        (
            settings.sized_across_heads(cfg) and replicated(vllm_config),
            f"{settings.budget_knobs(cfg)} splits a budget across the KV heads, and "
            f"tensor_parallel_size={parallel.tensor_parallel_size} does not divide the model's "
            f"{vllm_config.model_config.get_total_num_kv_heads()} KV heads (vLLM replicates them): a "
            "tensor_parallel_size that divides them (vllm serve: --tensor-parallel-size)",
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
            vllm_config.cache_config.cache_dtype not in ("auto", *paged.FP8),
            f"a KV cache of {vllm_config.cache_config.cache_dtype} (the plugin reads the model's dtype and FP8 "
            f"with one scale per layer for keys and one for values): {FP8_FLAG}",
        ),
        (
            getattr(vllm_config.cache_config, "enable_extensible_kv_cache", None),
            "the extensible KV cache sizes the pool after the warm-up, past the plugin's own memory taken out of "
            "it: enable_extensible_kv_cache=False (vllm serve: --no-enable-extensible-kv-cache)",
        ),
        (
            vllm_config.kv_transfer_config is not None or getattr(vllm_config.cache_config, "kv_offloading_size", None),
            "a KV connector or KV offloading supplies and stores blocks by hashes of tokens the plugin "
            "rewrote, and tokens whose queries the eviction never saw: drop kv_transfer_config= and "
            "kv_offloading_size= (vllm serve: --kv-transfer-config, --kv-offloading-size)",
        ),
    ]
    causes += [(True, f"{model.model} {why}; the plugin serves decoder-only full-attention models") for why in _model_kinds(model)]
    return [f"{settings.ENV}: {why}" for refused, why in causes if refused]


def _model_kinds(model_config) -> list[str]:
    """What of the model the plugin cannot evict, from vLLM's ``ModelConfig``: one line each."""
    kinds = [
        (model_config.uses_alibi, "biases attention by ALiBi from each key's index, which eviction changes"),
        (model_config.is_hybrid or model_config.has_inner_state, "keeps Mamba or linear-attention state"),
        (model_config.is_attention_free, "has no attention layers"),
        (model_config.is_encoder_decoder, "is an encoder-decoder model (cross-attention)"),
        (getattr(model_config, "attention_chunk_size", None), "has chunked-local attention layers"),
        (model_config.use_mla, "caches a latent per token (MLA), not keys and values per head"),
    ]
    return [why for found, why in kinds if found]


def cache_groups(kv_cache_config) -> list[str]:
    """Why the engine's KV cache groups are not ones the plugin evicts (one line each): it evicts one
    group of plain full attention (``FullAttentionSpec`` itself, no sliding window or chunk), reading
    and cutting that group's blocks, and leaves sliding-window groups (``SlidingWindowSpec``: a hybrid
    model's, Gemma 2 and 3, gpt-oss) to vLLM's own window; any other group (chunked-local, MLA,
    cross-attention, Mamba state) would lose blocks it still reads, and a second full-attention group
    would keep blocks its layers' eviction dropped."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    full = [g for g in groups if _plain(g.kv_cache_spec, FullAttentionSpec)]
    lines = [
        f"the KV cache group {_group(g)} is neither plain full attention nor a sliding window"
        for g in groups
        if not (_plain(g.kv_cache_spec, FullAttentionSpec) or _plain(g.kv_cache_spec, SlidingWindowSpec))
    ]
    if len(full) != 1:
        lines.append(
            f"the model's KV cache has {len(full)} groups of full attention ({', '.join(_group(g) for g in groups)})"
        )
    return [f"{settings.ENV}: {line}; the plugin evicts one full-attention group" for line in lines]


def pool(vllm_config, kv_cache_config, cfg, free: int) -> list[str]:
    """Why a pool of ``free`` blocks (vLLM's null block aside) cannot serve a request of
    ``max_model_len`` under ``cfg`` (one line, or none): the evicted group's ``settings.most_blocks``
    and every other group's own (vLLM's ``max_memory_usage_bytes``) must fit at once, or a request
    computed again near ``max_model_len`` waits for blocks that never come (vLLM's own check counts
    ``max_model_len`` alone)."""
    cache, max_len = vllm_config.cache_config, vllm_config.model_config.max_model_len
    caching, evicted = bool(cache.enable_prefix_caching), evicted_group(kv_cache_config)
    others = sum(
        -(-g.kv_cache_spec.max_memory_usage_bytes(vllm_config) // g.kv_cache_spec.page_size_bytes)
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if i != evicted
    )
    block = kv_cache_config.kv_cache_groups[evicted].kv_cache_spec.block_size

    def need(length: int) -> int:
        return others + settings.most_blocks(cfg, length, block, caching)

    if need(max_len) <= free:
        return []
    blocks = -(-max_len // block)
    extra = need(max_len) - others - blocks
    parts = [f"{blocks} for {max_len} entries"]
    if extra:
        why = "fresh blocks in its first eviction under prefix caching" if caching else "its heads' counts rounded up"
        parts.append(f"{extra} for the entries it keeps ({why})")
    if others:
        parts.append(f"{others} for the sliding-window groups")
    fits = next((n for n in range(max_len - block, 0, -block) if need(n) <= free), 0)
    lower = f"max_model_len={fits} (vllm serve: --max-model-len {fits})" if fits else "a shorter max_model_len"
    if caching and others + settings.most_blocks(cfg, max_len, block, False) <= free:
        lower += ", or enable_prefix_caching=False (vllm serve: --no-enable-prefix-caching)"
    return [
        f"{settings.ENV}: the KV cache holds {free} blocks of {block} tokens, and one request of "
        f"max_model_len={max_len} may hold {need(max_len)} at once ({', '.join(parts)}): give it "
        f"{need(max_len) - free} more (kv_cache_memory_bytes or gpu_memory_utilization; vllm serve: "
        f"--kv-cache-memory-bytes or --gpu-memory-utilization), or {lower}"
    ]


def evicted_group(kv_cache_config) -> int:
    """The index of the KV cache group the plugin evicts (``cache_groups`` allows one): its plain full
    attention; the others, sliding windows, are vLLM's to free."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    return next(i for i, g in enumerate(groups) if _plain(g.kv_cache_spec, FullAttentionSpec))


def _plain(spec, kind) -> bool:
    """``spec`` is ``kind`` itself (no subclass), causal and without chunks; a full-attention one without a
    sliding window."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return (
        type(spec) is kind
        and not getattr(spec, "non_causal", False)
        and getattr(spec, "attention_chunk_size", None) is None
        and (kind is not FullAttentionSpec or spec.sliding_window is None)
    )


def _group(group) -> str:
    """``FullAttentionSpec(sliding_window=512) of 12 layers (model.layers.0 ...)``."""
    spec = group.kv_cache_spec
    extra = [f"{k}={getattr(spec, k)}" for k in ("sliding_window", "attention_chunk_size") if getattr(spec, k, None)]
    names = group.layer_names
    return f"{type(spec).__name__}({', '.join(extra)}) of {len(names)} layers ({names[0] if names else ''} ...)"


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


def replicated(vllm_config) -> bool:
    """Tensor parallelism over more ranks than KV heads, or a count that does not divide them."""
    ranks = vllm_config.parallel_config.tensor_parallel_size
    return ranks > 1 and vllm_config.model_config.get_total_num_kv_heads() % ranks != 0


def bind_model(vllm_config, cfg) -> None:
    """``settings.bind_model`` with this engine's model (every rank's heads) and ranks; a table that does not
    fit it raises a one-line ValueError naming the knob's file."""
    m, p = vllm_config.model_config, vllm_config.parallel_config
    ranks = p.tensor_parallel_size
    try:  # every layer, whatever pipeline stage holds it
        settings.bind_model(
            cfg, m.get_total_num_hidden_layers(), m.get_num_attention_heads(p) * ranks, m.get_total_num_kv_heads(), ranks
        )
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
    """``EngineArgs.create_engine_config``, then ``check_config`` with ``unhooked``; knobs given by
    ``RESTKV_VLLM`` alone go into the engine's own config (``carry``)."""

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        if check_config(config, unhooked) is not None:
            carry(config)
        return config

    return wrapped


def carry(vllm_config) -> None:
    """Knobs set by ``RESTKV_VLLM`` alone into ``additional_config['restkv']``: vLLM hands its config to
    every process of the engine, workers on other nodes included, whose environment is not this one's
    (Ray's workers do not inherit it)."""
    extra = vllm_config.additional_config or {}
    if extra.get("restkv") is None and os.environ.get(settings.ENV):
        vllm_config.additional_config = {**extra, "restkv": json.loads(os.environ[settings.ENV])}


def worker_config(worker) -> str | None:
    """The config the plugin runs in ``worker``'s model runner, as JSON (None: it runs none); asked of
    every worker once the KV cache exists (``workers_agree``)."""
    plugin = getattr(worker.model_runner, "_restkv", None)
    return None if plugin is None else _text(plugin.cfg)


def _text(cfg) -> str:
    return json.dumps(cfg.as_dict(), sort_keys=True, default=str)


def workers_agree(orig):
    """``EngineCore._initialize_kv_caches``, then every worker asked the config its plugin runs
    (``worker_config``): a worker without the plugin (its package not installed on its node, vLLM's
    general plugins not loaded there) or with other knobs would read blocks the scheduler freed, so the
    engine stops before any request, naming the worker."""

    @functools.wraps(orig)
    def wrapped(self, vllm_config, *args, **kwargs):
        out = orig(self, vllm_config, *args, **kwargs)
        cfg = settings.from_env(vllm_config.additional_config)
        if cfg is not None:
            mine = _text(cfg)
            for rank, theirs in enumerate(self.model_executor.collective_rpc(worker_config)):
                if theirs != mine:
                    said = "runs without the plugin" if theirs is None else f"runs other knobs ({theirs})"
                    raise RuntimeError(
                        f"restkv.vllm: worker {rank} of this engine {said}; the scheduler evicts with {mine}: "
                        "install restkv and plugins/restkv_vllm in every node's environment, same versions"
                    )
        return out

    return wrapped
