"""Every place restkv touches vLLM: wrappers around its V1 engine's functions (``install``), each
passing through when the engine runs without the plugin's config.

Scheduler (engine core process):

- ``EngineArgs.create_engine_config``: the refusals, all at once, in the caller's process, before
  any engine starts (``refusals``).
- ``Scheduler.__init__``: the scheduler's ``Blocks`` (offsets, the step's evictions).
- ``KVCacheManager.get_computed_blocks``: a prefix-cache hit stops where the queries an eviction
  reads begin (``settings.hit_limit``).
- ``KVCacheManager.allocate_slots``: whether the request evicts at the end of this step
  (``settings.eviction``); ``KVCacheCoordinator.get_num_blocks_to_allocate`` /
  ``allocate_new_blocks`` then count the entries it holds, plus the fresh blocks of a first
  eviction under prefix caching; ``free`` / ``pop_blocks_for_free`` forget it.
- ``Scheduler.update_from_output``: after the step, the blocks past the kept ones go back to the
  pool (a block other requests share keeps its other references, and a cached one its hash: it was
  never written), and an evicted request's blocks are never cached.

Worker (each tensor-parallel rank):

- ``GPUModelRunner.__init__`` (and ``InputBatch.__init__``: block-table rows wide enough for the
  fresh blocks), ``load_model`` (each layer's o_proj): the ``Worker``.
- ``GPUModelRunner._update_states``: forget finished and resumed requests, cut the block-table rows
  evicted last step to their kept blocks.
- ``GPUModelRunner._prepare_inputs``: positions stay logical (the model's RoPE) while the slot mapping
  and sequence lengths count the entries held; the step's batch to the ``Worker``.
- ``GPUModelRunner.execute_model``: the step's ``Worker`` visible to the attention layers; its
  block-table edits kept for the next step.
- each attention backend's ``forward``: after the layer's attention, ``Worker.layer`` on the layer's
  paged cache (``restkv.vllm.paged``: the CPU backend's layout probed from its own writer, the
  GPU backends' declared).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from . import paged, settings
from .worker import Worker

NEVER_CACHED = (
    1 << 62
)  # an evicted request's count of cached blocks: none of its blocks is hashed again
_CURRENT: list = [None]  # the Worker of the step in flight (read by the attention wrapper)
_WIDER: list = [0]  # blocks added to every block-table row (set while a runner is built)


# ---- refusals ----


def refusals(vllm_config, cfg) -> list[str]:
    """One line per cause the plugin cannot run with, naming the ``LLM(...)`` keyword and the
    ``vllm serve`` flag."""
    parallel = vllm_config.parallel_config
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
            vllm_config.model_config.get_sliding_window() is not None,
            f"{vllm_config.model_config.model} has sliding-window attention layers; the plugin runs "
            "full-attention models",
        ),
        (
            parallel.pipeline_parallel_size > 1,
            "pipeline parallelism: pipeline_parallel_size=1 (vllm serve: --pipeline-parallel-size 1)",
        ),
        (
            parallel.tensor_parallel_size > 1 and settings.mixes_heads(cfg) is not None,
            f"{settings.mixes_heads(cfg)}, and tensor parallelism gives each rank some heads: "
            "tensor_parallel_size=1 (vllm serve: --tensor-parallel-size 1) or another method",
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
        (
            vllm_config.device_config.device_type != "cpu",
            "the plugin runs on vLLM's CPU backend here: device='cpu' (vllm serve: --device cpu)",
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


def _create_engine_config(orig):
    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        check_config(config)
        return config

    return create_engine_config


# ---- scheduler ----


@dataclass
class Blocks:
    """The scheduler's side: entries each request evicted, and the evictions of the step scheduled."""

    cfg: object
    caching: bool
    block_size: int
    offsets: dict = field(default_factory=dict)  # request id -> logical - held entries
    due: dict = field(default_factory=dict)  # request id -> settings.Eviction, this step's

    def held(self, request_id: str, tokens: int) -> int:
        return tokens - self.offsets.get(request_id, 0)

    def slots(self, request_id: str, tokens: int) -> int:
        """Slots a request needs for ``tokens`` logical tokens: the entries it holds, and the
        fresh blocks of its first eviction under prefix caching in this step."""
        e = self.due.get(request_id)
        return e.slots if e is not None and e.fresh else self.held(request_id, tokens)

    def forget(self, request_id: str) -> None:
        self.offsets.pop(request_id, None)
        self.due.pop(request_id, None)


def _scheduler_init(orig):
    @functools.wraps(orig)
    def init(self, vllm_config, *args, **kwargs):
        orig(self, vllm_config, *args, **kwargs)
        cfg = check_config(vllm_config)
        manager = self.kv_cache_manager
        manager._restkv = manager.coordinator._restkv = (
            None
            if cfg is None
            else Blocks(cfg, bool(manager.enable_caching), vllm_config.cache_config.block_size)
        )

    return init


def _get_computed_blocks(orig):
    @functools.wraps(orig)
    def get_computed_blocks(self, request):
        blocks, hit, boundary = orig(self, request)
        state = getattr(self, "_restkv", None)
        if state is None or hit == 0:
            return blocks, hit, boundary
        limit = settings.hit_limit(state.cfg, min(request.num_tokens, request.num_prompt_tokens))
        if hit > limit:
            hit = limit // state.block_size * state.block_size
            blocks = self.truncate_computed_blocks(blocks, hit)
        return blocks, hit, boundary

    return get_computed_blocks


def _allocate_slots(orig):
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def allocate_slots(self, request, *args, **kwargs):
        state = getattr(self, "_restkv", None)
        if state is not None:
            bound = signature.bind(self, request, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            computed = (
                request.num_computed_tokens
                + a["num_new_computed_tokens"]
                + a["num_external_computed_tokens"]
            )
            e = settings.eviction(
                state.cfg,
                computed,
                a["num_new_tokens"],
                request.num_prompt_tokens,
                state.offsets.get(request.request_id, 0),
                state.caching,
                state.block_size,
            )
            if e is None:
                state.due.pop(request.request_id, None)
            else:
                state.due[request.request_id] = e
        return orig(self, request, *args, **kwargs)

    return allocate_slots


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
        s = getattr(self, "_restkv", None)
        if s is None:
            return orig(
                self,
                request_id,
                num_tokens,
                new_computed_blocks,
                num_encoder_tokens,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                **kwargs,
            )
        return orig(
            self,
            request_id,
            s.slots(request_id, num_tokens),
            new_computed_blocks,
            num_encoder_tokens,
            s.held(request_id, total_computed_tokens),
            s.held(request_id, num_local_computed_tokens),
            s.slots(request_id, num_tokens_main_model),
            **kwargs,
        )

    return get_num_blocks_to_allocate


def _allocate_new_blocks(orig):
    @functools.wraps(orig)
    def allocate_new_blocks(
        self, request_id, num_tokens, num_tokens_main_model, num_encoder_tokens=0
    ):
        s = getattr(self, "_restkv", None)
        if s is not None:
            num_tokens = s.slots(request_id, num_tokens)
            num_tokens_main_model = s.slots(request_id, num_tokens_main_model)
        return orig(self, request_id, num_tokens, num_tokens_main_model, num_encoder_tokens)

    return allocate_new_blocks


def _forget(orig):
    @functools.wraps(orig)
    def forget(self, request_id, *args, **kwargs):
        s = getattr(self, "_restkv", None)
        if s is not None:
            s.forget(request_id)
        return orig(self, request_id, *args, **kwargs)

    return forget


def _update_from_output(orig):
    """After the original: each request that evicted in the step keeps its kept blocks only."""

    @functools.wraps(orig)
    def update_from_output(self, scheduler_output, model_runner_output):
        out = orig(self, scheduler_output, model_runner_output)
        state = getattr(self.kv_cache_manager, "_restkv", None)
        if state is None:
            return out
        for req_id in scheduler_output.num_scheduled_tokens:
            e = state.due.pop(req_id, None)
            request = self.requests.get(req_id)
            if e is None or request is None or request.is_finished():
                continue
            for manager in self.kv_cache_manager.coordinator.single_type_managers:
                _keep_evicted(manager, req_id, e, state.caching)
            state.offsets[req_id] = state.offsets.get(req_id, 0) + e.held - e.budget
        return out

    return update_from_output


def _keep_evicted(manager, req_id: str, e: settings.Eviction, caching: bool) -> None:
    """Keep the request's kept blocks; the others go back to the pool, tail first."""
    blocks = manager.req_to_blocks.get(req_id)
    if not blocks:
        return
    first, count = e.first_kept_block, e.kept_blocks
    gone = blocks[:first] + blocks[first + count :]
    blocks[:] = blocks[first : first + count]
    if caching:
        manager.num_cached_block[req_id] = NEVER_CACHED
    manager.block_pool.free_blocks(reversed(gone))


# ---- worker: model runner ----


def _input_batch_init(orig):
    @functools.wraps(orig)
    def init(self, *args, **kwargs):
        if _WIDER[0]:
            signature = inspect.signature(orig)
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["max_num_blocks_per_req"] = [
                n + _WIDER[0] for n in bound.arguments["max_num_blocks_per_req"]
            ]
            return orig(*bound.args, **bound.kwargs)
        return orig(self, *args, **kwargs)

    return init


def _runner_init(orig):
    @functools.wraps(orig)
    def init(self, vllm_config, *args, **kwargs):
        cfg = settings.from_env(vllm_config.additional_config)
        cache = vllm_config.cache_config
        max_len = vllm_config.model_config.max_model_len
        _WIDER[0] = 0 if cfg is None else settings.extra_blocks(cfg, max_len, cache.block_size)
        orig(self, vllm_config, *args, **kwargs)
        self._restkv = (
            None
            if cfg is None
            else Worker(cfg, self.max_num_reqs, bool(cache.enable_prefix_caching), cache.block_size)
        )
        self._restkv_pending = {}

    return init


def _load_model(orig):
    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        worker = getattr(self, "_restkv", None)
        if worker is not None:
            worker.index_layers(o_proj_readers(self.model))
        return out

    return load_model


def o_proj_readers(model) -> dict:
    """{attention layer name: a function returning its o_proj weight W_O [hidden, Hq d] on this
    worker (its own heads' columns), read once}."""
    readers = {}
    for module in model.modules():
        attn, o_proj = getattr(module, "attn", None), getattr(module, "o_proj", None)
        name = getattr(attn, "layer_name", None)
        if name is not None:
            readers[name] = (
                None
                if o_proj is None
                else functools.lru_cache(maxsize=1)(functools.partial(o_proj_weight, o_proj))
            )
    return readers


@torch.no_grad()
def o_proj_weight(o_proj) -> torch.Tensor:
    """W_O [hidden, in] of a row-parallel linear layer on this worker: its quantization method's
    product with the identity, without the bias or the reduction over ranks (products with 1 and 0
    are exact). vLLM's CPU layers drop their dense weight after repacking it, and a quantized layer
    holds none: the product is the weight the layer applies."""
    weight = o_proj.weight
    width = o_proj.input_size_per_partition
    eye = torch.eye(width, dtype=o_proj.params_dtype, device=weight.device)
    return o_proj.quant_method.apply(o_proj, eye, bias=None).t().contiguous()


def _update_states(orig):
    """Before the original: forget finished and resumed requests, cut the rows evicted last step."""

    @functools.wraps(orig)
    def update_states(self, scheduler_output):
        worker = getattr(self, "_restkv", None)
        if worker is not None:
            cached = scheduler_output.scheduled_cached_reqs
            gone = set(scheduler_output.finished_req_ids) | set(cached.resumed_req_ids)
            gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
            worker.forget(gone)
            for req_id, edit in self._restkv_pending.items():
                if req_id not in gone:
                    _cut_row(self, req_id, *edit)
            self._restkv_pending.clear()
        return orig(self, scheduler_output)

    return update_states


def _cut_row(runner, req_id: str, first: int, count: int) -> None:
    """Keep blocks ``first`` .. ``first + count - 1`` of the request's block ids and block-table
    row."""
    req_state = runner.requests.get(req_id)
    row = runner.input_batch.req_id_to_index.get(req_id)
    for group, table in enumerate(runner.input_batch.block_table.block_tables):
        if req_state is not None:
            ids = req_state.block_ids[group]
            ids[:] = ids[first : first + count]
        if row is not None:
            held = table.num_blocks_per_row[row]
            table.block_table.np[row, :count] = table.block_table.np[row, first : first + count]
            table.block_table.np[row, count:held] = 0
            table.num_blocks_per_row[row] = count


def _prepare_inputs(orig):
    """After the original: slots and sequence lengths of the entries held; the step's batch."""

    @functools.wraps(orig)
    def prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = orig(self, scheduler_output, num_scheduled_tokens)
        worker = getattr(self, "_restkv", None)
        if worker is not None:
            batch = self.input_batch
            n = batch.num_reqs
            req_ids = batch.req_ids[:n]
            _held_entries(self, worker.offsets(req_ids), num_scheduled_tokens)
            table = batch.block_table.block_tables[0]
            blocks = [
                table.block_table.np[i, : table.num_blocks_per_row[i]].copy() for i in range(n)
            ]
            worker.begin(
                req_ids,
                batch.num_computed_tokens_cpu[:n],
                num_scheduled_tokens[:n],
                batch.num_prompt_tokens[:n],
                blocks,
                self.device,
            )
        return out

    return prepare_inputs


def _held_entries(runner, offsets: np.ndarray, scheduled: np.ndarray) -> None:
    """Slot mapping and sequence lengths by entries held (positions minus each request's offset)."""
    if not offsets.any():
        return
    num_reqs = len(offsets)
    tokens = int(scheduled[:num_reqs].sum())
    per_token = torch.from_numpy(np.repeat(offsets, scheduled[:num_reqs])).to(
        runner.positions.device
    )
    runner.seq_lens[:num_reqs] -= torch.from_numpy(offsets).to(runner.seq_lens)
    held = runner.positions[:tokens] - per_token
    runner.input_batch.block_table.compute_slot_mapping(
        num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], held
    )


def _execute_model(orig):
    """Around the original: the step's Worker for the attention layers; then its edits."""

    @functools.wraps(orig)
    def execute_model(self, *args, **kwargs):
        worker = getattr(self, "_restkv", None)
        if worker is None:
            return orig(self, *args, **kwargs)
        _CURRENT[0] = worker
        try:
            return orig(self, *args, **kwargs)
        finally:
            _CURRENT[0] = None
            for req_id, first, count in worker.end():
                self._restkv_pending[req_id] = (first, count)

    return execute_model


# ---- worker: attention ----


def _attention_forward(layout):
    """A backend's ``forward`` followed by ``Worker.layer`` on the layer's cache as ``layout(impl,
    layer, kv_cache)`` (a ``restkv.vllm.paged.Paged``) reads it."""

    def wrap(orig):
        @functools.wraps(orig)
        def forward(
            self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
        ):
            out = orig(
                self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
            )
            worker = _CURRENT[0]
            if worker is not None and worker.step and attn_metadata is not None:
                tokens = attn_metadata.num_actual_tokens
                q = query[:tokens].view(tokens, self.num_heads, self.head_size)
                softcap = getattr(self, "logits_soft_cap", None)
                worker.layer(
                    layer.layer_name, q, layout(self, layer, kv_cache), self.scale, softcap
                )
            return out

        return forward

    return wrap


def cpu_layout(impl, layer, kv_cache) -> paged.Paged:
    """vLLM's CPU backend: [blocks, Hkv, block_size, 2 d], each block packed for its ISA by
    ``cpu_attn_reshape_and_cache`` (probed once per block shape, dtype and ISA)."""
    from vllm import _custom_ops as ops

    def writer(cache, keys, values, slots):
        blocks, heads, size, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys,
            values,
            key_cache,
            value_cache,
            slots,
            layer.isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )

    _, heads, size, _ = kv_cache.shape
    return paged.probed(kv_cache, size, heads, impl.head_size, writer, layer.isa)


# ---- installation ----


def targets() -> tuple:
    """(owner, function name, wrapper) of every function the plugin wraps, for the installed
    vLLM."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return (
        (EngineArgs, "create_engine_config", _create_engine_config),
        (Scheduler, "__init__", _scheduler_init),
        (Scheduler, "update_from_output", _update_from_output),
        (KVCacheManager, "get_computed_blocks", _get_computed_blocks),
        (KVCacheManager, "allocate_slots", _allocate_slots),
        (KVCacheCoordinator, "get_num_blocks_to_allocate", _num_blocks_to_allocate),
        (KVCacheCoordinator, "allocate_new_blocks", _allocate_new_blocks),
        (KVCacheCoordinator, "free", _forget),
        (KVCacheCoordinator, "pop_blocks_for_free", _forget),
        (InputBatch, "__init__", _input_batch_init),
        (GPUModelRunner, "__init__", _runner_init),
        (GPUModelRunner, "load_model", _load_model),
        (CPUModelRunner, "load_model", _load_model),
        (GPUModelRunner, "_update_states", _update_states),
        (GPUModelRunner, "_prepare_inputs", _prepare_inputs),
        (GPUModelRunner, "execute_model", _execute_model),
        (CPUAttentionBackendImpl, "forward", _attention_forward(cpu_layout)),
    )


def install() -> None:
    """Wrap the functions of ``targets()`` (idempotent)."""
    for owner, name, wrap in targets():
        current = owner.__dict__.get(name)
        if current is not None and not getattr(current, "_restkv", False):
            wrapped = wrap(current)
            wrapped._restkv = True
            setattr(owner, name, wrapped)
