"""The overrides of vLLM 0.32.0's V1 engine that evict after prefill (see ``restkv.vllm`` for the
list).

Three places change, each a wrapper around the original that passes through when the plugin is off:

- attention (worker): after ``CPUAttentionBackendImpl.forward`` of a step that holds a request's
  whole prompt, each layer scores the request's queries and keys (``restkv.vllm.scoring``) and
  writes its kept entries into the request's first B slots with vLLM's own cache writer
  (``cpu_attn_reshape_and_cache``), one row per kept index j holding each KV head's j-th entry;
- model runner (worker): positions stay logical (RoPE continues at L) while the slot mapping and the
  sequence lengths count held entries (``_prepare_inputs``, offset L - B per evicted request); the
  next step truncates the request's block-table row to its kept blocks (``_update_states``);
- KV cache (scheduler): once the step has run, the request's blocks past the kept ones go back to
  the pool (``Scheduler.update_from_output``) and its later allocations count held entries
  (``KVCacheCoordinator.get_num_blocks_to_allocate`` / ``allocate_new_blocks``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from ..scoring.observe import wo_factor
from . import settings
from .scoring import kept_entries, slot_rows

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass
class WorkerState:
    """One model runner's eviction state."""

    cfg: object
    # attention layer name -> its o_proj module, W_O [hidden, Hq d] and R [Hq, d, d] (once read)
    o_proj: dict = field(default_factory=dict)
    o_proj_weight: dict = field(default_factory=dict)
    wo: dict = field(default_factory=dict)
    # attention layer name -> its index among the attention layers
    rank: dict = field(default_factory=dict)
    # request id -> entries evicted (logical - held)
    offsets: dict = field(default_factory=dict)
    # request id -> entries kept, its block-table row not truncated yet
    pending: dict = field(default_factory=dict)
    # (first token, tokens, request id, kept) of each request evicting in this step
    step: list = field(default_factory=list)
    # request id -> {layer name: kept positions [Hkv, B]} (the last few requests)
    kept: dict = field(default_factory=dict)


_RECORDED = 8  # requests whose kept positions stay readable (``WorkerState.kept``)
_CURRENT: list = [None]  # the WorkerState of the step in flight (read by the attention wrapper)


def o_proj_weight(state: WorkerState, name: str, dtype: torch.dtype):
    """The layer's W_O [hidden, Hq d] (None: no o_proj found), read once.

    vLLM's CPU linear layers repack their weight for oneDNN and drop the dense one
    (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``), so it is read back exactly
    through the layer itself: ``o_proj(I) - o_proj(0)`` = W_O^T (products with 1 and 0 are exact).
    """
    module = state.o_proj.get(name)
    if module is None:
        return None
    if name not in state.o_proj_weight:
        weight = module.weight
        if weight.numel() == 0:
            width = module.input_size_per_partition
            eye = torch.eye(width, dtype=dtype, device=weight.device)
            weight = (_output(module(eye)) - _output(module(torch.zeros_like(eye[:1])))).t()
        state.o_proj_weight[name] = weight.detach().contiguous()
    return state.o_proj_weight[name]


def layer_wo(state: WorkerState, name: str, dtype: torch.dtype, heads: int) -> torch.Tensor:
    """The layer's W_O factor R [Hq, d, d], computed once."""
    if name not in state.wo:
        state.wo[name] = wo_factor(o_proj_weight(state, name, dtype), heads)
    return state.wo[name]


def _output(out):
    return out[0] if isinstance(out, tuple) else out


def _index_layers(state: WorkerState, model) -> None:
    for module in model.modules():
        attn = getattr(module, "attn", None)
        o_proj = getattr(module, "o_proj", None)
        name = getattr(attn, "layer_name", None)
        if name is not None and o_proj is not None:
            state.o_proj[name] = o_proj
    names = sorted(
        state.o_proj, key=lambda n: int(_LAYER.search(n).group(1)) if _LAYER.search(n) else 0
    )
    state.rank.update({name: i for i, name in enumerate(names)})


# ---- worker: model runner ----


def _runner_init(orig):
    @functools.wraps(orig)
    def init(self, vllm_config, *args, **kwargs):
        orig(self, vllm_config, *args, **kwargs)
        cfg = settings.from_env(vllm_config.additional_config)
        self._restkv = None if cfg is None else WorkerState(cfg)

    return init


def _load_model(orig):
    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if getattr(self, "_restkv", None) is not None:
            _index_layers(self._restkv, self.model)
        return out

    return load_model


def _update_states(orig):
    """Before the original: forget finished and resumed requests, truncate the rows evicted last
    step."""

    @functools.wraps(orig)
    def update_states(self, scheduler_output):
        state = getattr(self, "_restkv", None)
        if state is not None:
            gone = set(scheduler_output.finished_req_ids) | set(
                scheduler_output.scheduled_cached_reqs.resumed_req_ids
            )
            for req_id in gone:
                state.offsets.pop(req_id, None)
                state.pending.pop(req_id, None)
            for req_id, kept in state.pending.items():
                _truncate(self, req_id, kept)
            state.pending.clear()
        return orig(self, scheduler_output)

    return update_states


def _truncate(runner, req_id: str, kept: int) -> None:
    """Keep the first blocks of the request's block ids and block-table row: those holding ``kept``
    entries."""
    req_state = runner.requests.get(req_id)
    row = runner.input_batch.req_id_to_index.get(req_id)
    for group, table in enumerate(runner.input_batch.block_table.block_tables):
        blocks = -(-kept // table.block_size)
        if req_state is not None:
            del req_state.block_ids[group][blocks:]
        if row is not None and table.num_blocks_per_row[row] > blocks:
            table.block_table.np[row, blocks : table.num_blocks_per_row[row]] = 0
            table.num_blocks_per_row[row] = blocks


def _prepare_inputs(orig):
    """After the original: physical slot mapping and sequence lengths, and this step's evictions."""

    @functools.wraps(orig)
    def prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = orig(self, scheduler_output, num_scheduled_tokens)
        state = getattr(self, "_restkv", None)
        if state is not None:
            _held_entries(self, state, num_scheduled_tokens)
            state.step = _evictions(self, state, num_scheduled_tokens)
        return out

    return prepare_inputs


def _held_entries(runner, state: WorkerState, scheduled: np.ndarray) -> None:
    num_reqs = runner.input_batch.num_reqs
    offsets = np.array(
        [state.offsets.get(r, 0) for r in runner.input_batch.req_ids[:num_reqs]], dtype=np.int64
    )
    if not offsets.any():
        return
    tokens = int(scheduled.sum())
    per_token = torch.from_numpy(np.repeat(offsets, scheduled)).to(runner.positions.device)
    runner.seq_lens[:num_reqs] -= torch.from_numpy(offsets).to(runner.seq_lens)
    held = runner.positions[:tokens] - per_token
    runner.input_batch.block_table.compute_slot_mapping(
        num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], held
    )


def _evictions(runner, state: WorkerState, scheduled: np.ndarray) -> list:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = runner.query_start_loc.np[:num_reqs]
    out = []
    for i in range(num_reqs):
        kept = settings.kept_entries(
            int(batch.num_computed_tokens_cpu[i]),
            int(scheduled[i]),
            int(batch.num_prompt_tokens[i]),
            state.cfg.max_capacity_prompt,
        )
        if kept is not None:
            out.append((int(starts[i]), int(scheduled[i]), batch.req_ids[i], kept))
    return out


def _execute_model(orig):
    """Around the original: expose the step's evictions to the attention layers, then record their
    offsets."""

    @functools.wraps(orig)
    def execute_model(self, *args, **kwargs):
        state = getattr(self, "_restkv", None)
        if state is None:
            return orig(self, *args, **kwargs)
        _CURRENT[0] = state
        try:
            return orig(self, *args, **kwargs)
        finally:
            _CURRENT[0] = None
            for _, n, req_id, kept in state.step:
                state.offsets[req_id] = n - kept
                state.pending[req_id] = kept
            state.step = []

    return execute_model


# ---- worker: attention ----


def _attention_forward(orig):
    @functools.wraps(orig)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        state = _CURRENT[0]
        if state is not None and state.step and attn_metadata is not None and key is not None:
            _evict_layer(self, state, layer, query, key, value, kv_cache, attn_metadata)
        return out

    return forward


def _evict_layer(impl, state: WorkerState, layer, query, key, value, kv_cache, metadata) -> None:
    """Write each evicting request's kept entries into its first slots of this layer's cache."""
    from vllm import _custom_ops as ops

    name = layer.layer_name
    num_blocks, hkv, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, hkv, 2 * block_size, -1).chunk(2, dim=2)
    hq = impl.num_heads
    d = impl.head_size
    for start, n, req_id, kept_count in state.step:
        q = query[start : start + n].reshape(n, hq, d)
        k = key[start : start + n].reshape(n, hkv, d)
        v = value[start : start + n].reshape(n, hkv, d)
        has_o_proj = name in state.o_proj
        weight = functools.partial(o_proj_weight, state, name, query.dtype) if has_o_proj else None
        wo = functools.partial(layer_wo, state, name, query.dtype, hq) if has_o_proj else None
        kept = kept_entries(
            state.cfg,
            q,
            k,
            v,
            impl.scale,
            impl.logits_soft_cap,
            state.rank.get(name, 0),
            max(len(state.rank), 1),
            weight,
            wo,
        )
        rows_k, rows_v = slot_rows(kept)
        slots = metadata.slot_mapping[start : start + kept_count]
        ops.cpu_attn_reshape_and_cache(
            rows_k.to(key.dtype),
            rows_v.to(value.dtype),
            key_cache,
            value_cache,
            slots,
            layer.isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=impl.kv_cache_dtype,
        )
        _record(state, req_id, name, kept.positions[0])


def _record(state: WorkerState, req_id: str, layer_name: str, positions: torch.Tensor) -> None:
    if req_id not in state.kept and len(state.kept) >= _RECORDED:
        del state.kept[next(iter(state.kept))]
    state.kept.setdefault(req_id, {})[layer_name] = positions.detach().cpu()


# ---- scheduler ----


def check_config(vllm_config) -> object:
    """The plugin's config for this engine (None: off); a one-line ValueError for what the plugin
    does not handle."""
    cfg = settings.from_env(vllm_config.additional_config)
    if cfg is None:
        return None
    refusals = (
        (
            vllm_config.cache_config.enable_prefix_caching,
            "prefix caching shares blocks that eviction rewrites: pass enable_prefix_caching=False",
        ),
        (
            vllm_config.scheduler_config.enable_chunked_prefill,
            "chunked prefill splits the prompt's queries over steps: "
            "pass enable_chunked_prefill=False",
        ),
        (
            vllm_config.speculative_config is not None,
            "speculative decoding is not supported: drop speculative_config",
        ),
        (
            vllm_config.scheduler_config.async_scheduling,
            "asynchronous scheduling allocates the next step before eviction frees blocks: "
            "pass async_scheduling=False",
        ),
        (
            vllm_config.model_config.get_sliding_window() is not None,
            "sliding-window attention layers are not supported (full-attention models only)",
        ),
        (
            vllm_config.parallel_config.tensor_parallel_size
            * vllm_config.parallel_config.pipeline_parallel_size
            > 1,
            "tensor and pipeline parallelism are not supported (one worker)",
        ),
        (vllm_config.cache_config.cache_dtype != "auto", "kv_cache_dtype must be 'auto'"),
        (
            vllm_config.device_config.device_type != "cpu",
            "the plugin runs on vLLM's CPU attention backend only",
        ),
    )
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{settings.ENV}: {why}")
    return cfg


def _create_engine_config(orig):
    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        check_config(config)
        return config

    return create_engine_config


def _scheduler_init(orig):
    @functools.wraps(orig)
    def init(self, vllm_config, *args, **kwargs):
        orig(self, vllm_config, *args, **kwargs)
        self._restkv = check_config(vllm_config)
        if self._restkv is not None:
            self.kv_cache_manager.coordinator._restkv_offsets = {}

    return init


def _update_from_output(orig):
    """After the original: free the blocks past the kept ones of each request that evicted in that
    step."""

    @functools.wraps(orig)
    def update_from_output(self, scheduler_output, model_runner_output):
        cfg = getattr(self, "_restkv", None)
        evicted = [] if cfg is None else _scheduled_evictions(self, cfg, scheduler_output)
        out = orig(self, scheduler_output, model_runner_output)
        for request, n, kept in evicted:
            if self.requests.get(request.request_id) is request and not request.is_finished():
                _free_evicted(self.kv_cache_manager.coordinator, request.request_id, n, kept)
        return out

    return update_from_output


def _scheduled_evictions(scheduler, cfg, scheduler_output) -> list:
    out = []
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests.get(req_id)
        if request is None:
            continue
        before = (
            request.num_computed_tokens - n
        )  # the scheduler counted the step's tokens when it scheduled them
        kept = settings.kept_entries(before, n, request.num_prompt_tokens, cfg.max_capacity_prompt)
        if kept is not None:
            out.append((request, n, kept))
    return out


def _free_evicted(coordinator, req_id: str, n: int, kept: int) -> None:
    for manager in coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(req_id)
        if not blocks:
            continue
        keep = -(-kept // manager.block_size)
        freed = blocks[keep:]
        del blocks[keep:]
        manager.block_pool.free_blocks(reversed(freed))
    coordinator._restkv_offsets[req_id] = n - kept


def _held(coordinator, request_id: str, tokens: int) -> int:
    return tokens - getattr(coordinator, "_restkv_offsets", {}).get(request_id, 0)


def _num_blocks_to_allocate(orig):
    @functools.wraps(orig)
    def get_num_blocks_to_allocate(
        self,
        request_id,
        num_tokens,
        new_computed_blocks,
        num_encoder_tokens,
        total_computed_tokens,
        num_local_computed_tokens,
        num_tokens_main_model,
        **kwargs,
    ):
        return orig(
            self,
            request_id,
            _held(self, request_id, num_tokens),
            new_computed_blocks,
            num_encoder_tokens,
            _held(self, request_id, total_computed_tokens),
            _held(self, request_id, num_local_computed_tokens),
            _held(self, request_id, num_tokens_main_model),
            **kwargs,
        )

    return get_num_blocks_to_allocate


def _allocate_new_blocks(orig):
    @functools.wraps(orig)
    def allocate_new_blocks(
        self, request_id, num_tokens, num_tokens_main_model, num_encoder_tokens=0
    ):
        return orig(
            self,
            request_id,
            _held(self, request_id, num_tokens),
            _held(self, request_id, num_tokens_main_model),
            num_encoder_tokens,
        )

    return allocate_new_blocks


def _forget(orig):
    @functools.wraps(orig)
    def forget(self, request_id, *args, **kwargs):
        getattr(self, "_restkv_offsets", {}).pop(request_id, None)
        return orig(self, request_id, *args, **kwargs)

    return forget


# ---- installation ----


def install() -> None:
    """Wrap the overridden vLLM functions (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    targets = (
        (EngineArgs, "create_engine_config", _create_engine_config),
        (Scheduler, "__init__", _scheduler_init),
        (Scheduler, "update_from_output", _update_from_output),
        (KVCacheCoordinator, "get_num_blocks_to_allocate", _num_blocks_to_allocate),
        (KVCacheCoordinator, "allocate_new_blocks", _allocate_new_blocks),
        (KVCacheCoordinator, "free", _forget),
        (KVCacheCoordinator, "pop_blocks_for_free", _forget),
        (GPUModelRunner, "__init__", _runner_init),
        (CPUModelRunner, "load_model", _load_model),
        (GPUModelRunner, "_update_states", _update_states),
        (GPUModelRunner, "_prepare_inputs", _prepare_inputs),
        (GPUModelRunner, "execute_model", _execute_model),
        (CPUAttentionBackendImpl, "forward", _attention_forward),
    )
    for owner, name, wrap in targets:
        current = owner.__dict__[name]
        if not getattr(current, "_restkv", False):
            wrapped = wrap(current)
            wrapped._restkv = True
            setattr(owner, name, wrapped)
