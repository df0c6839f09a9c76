"""The model runner's side (each tensor-parallel rank), for both of vLLM's runners.

Common to V1 (``vllm.v1.worker.gpu_model_runner``, the CPU backend's and ``VLLM_USE_V2_MODEL_RUNNER=0``)
and V2 (``vllm.v1.worker.gpu.model_runner``, the CUDA default):

- ``__init__``: the ``Worker``; block-table rows widened for the fresh blocks of a first eviction
  (V1 ``InputBatch.__init__``, V2 ``BlockTables.__init__``);
- ``load_model``: each layer's o_proj reader (on its own device) and, where the config reads
  it, its W_O factor;
- ``execute_model``: the step's ``Worker`` visible to the attention layers, its cuts kept for the
  next step (V2: not for its dummy runs).

Then per runner (the same facts from each one's structures):

- V1 ``_update_states``: forget finished, preempted and resumed requests, cut the rows evicted last
  step (``req_state.block_ids`` and the block table's numpy row), record the step's new block ids;
  ``_prepare_inputs``: slots and sequence lengths of the entries held (the GPU lengths and the CPU
  bound FlashInfer reads), the step's batch to the ``Worker``.
- V2 ``finish_requests`` / ``add_requests``: forget finished, preempted and re-added requests;
  ``update_requests``: cut the rows evicted last step (a staged write and ``num_blocks``), record
  the new block ids; ``prepare_attn``: the slot mapping of the entries held, the step's batch to the
  ``Worker``; ``DefaultModelState.prepare_attn``: the attention metadata's sequence lengths of the
  entries held (the batch's own stay logical: the sampler reads them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import numpy as np
import torch

from .. import settings
from ..worker import Worker

CURRENT: list = [None]  # the Worker of the step in flight (read by the attention wrapper)
_WIDER: list = [0]  # blocks added to every block-table row (set while a runner is built)


# ---- common ----


def runner_init(orig):
    @functools.wraps(orig)
    def init(self, vllm_config, *args, **kwargs):
        cfg = settings.from_env(vllm_config.additional_config)
        cache = vllm_config.cache_config
        max_len = vllm_config.model_config.max_model_len
        _WIDER[0] = 0 if cfg is None else settings.extra_blocks(cfg, max_len, cache.block_size)
        orig(self, vllm_config, *args, **kwargs)
        caching = bool(cache.enable_prefix_caching)
        self._restkv = None if cfg is None else Worker(cfg, self.max_num_reqs, caching, cache.block_size)

    return init


def widened(argument: str):
    """A wrapper of a constructor whose per-group row widths ``argument`` get ``_WIDER`` more blocks."""

    def wrap(orig):
        signature = inspect.signature(orig)

        @functools.wraps(orig)
        def init(self, *args, **kwargs):
            if not _WIDER[0]:
                return orig(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments[argument] = [n + _WIDER[0] for n in bound.arguments[argument]]
            return orig(*bound.args, **bound.kwargs)

        return init

    return wrap


def load_model(orig):
    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        worker = getattr(self, "_restkv", None)
        if worker is not None:
            layers = [m.attn for m in self.model.modules() if hasattr(getattr(m, "attn", None), "layer_name")]
            heads = {getattr(a, "num_heads", None) for a in layers}  # this rank's Hq, one for all layers
            worker.index_layers(o_proj_readers(self.model), heads.pop() if len(heads) == 1 else None)
        return out

    return wrapped


def o_proj_readers(model) -> dict:
    """{attention layer name: a function returning its o_proj weight W_O [hidden, Hq d] on this
    worker (its own heads' columns), read at each call and not kept: the W_O factor is computed from
    it once (``Worker.index_layers``), a selection that reads the weight itself reads it for its
    step (``restkv.vllm.memory``)}."""
    readers = {}
    for module in model.modules():
        attn, o_proj = getattr(module, "attn", None), getattr(module, "o_proj", None)
        name = getattr(attn, "layer_name", None)
        if name is not None:
            readers[name] = None if o_proj is None else functools.partial(o_proj_weight, o_proj)
    return readers


@torch.no_grad()
def o_proj_weight(o_proj) -> torch.Tensor:
    """W_O [hidden, in] of a row-parallel linear layer on this worker: its quantization method's
    product with the identity, without the bias or the reduction over ranks (products with 1 and 0
    are exact), on the layer's device. vLLM's CPU layers drop their dense weight after repacking
    it, and a quantized layer holds none: the product is the weight the layer applies."""
    weight = o_proj.weight
    eye = torch.eye(o_proj.input_size_per_partition, dtype=o_proj.params_dtype, device=weight.device)
    return o_proj.quant_method.apply(o_proj, eye, bias=None).t().contiguous()


def execute_model(orig):
    """Around the original: the step's Worker for the attention layers; then, once the step has
    run, its cuts (``Worker.end``, which raises if a layer's attention ran without the plugin)."""
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        worker = getattr(self, "_restkv", None)
        if worker is None or _dummy(signature, self, args, kwargs):
            return orig(self, *args, **kwargs)
        CURRENT[0] = worker
        try:
            out = orig(self, *args, **kwargs)
        finally:
            CURRENT[0] = None
        step = signature.bind(self, *args, **kwargs).arguments["scheduler_output"]
        worker.end(step.total_num_scheduled_tokens)
        return out

    return wrapped


def _dummy(signature, runner, args, kwargs) -> bool:
    if "dummy_run" not in signature.parameters:
        return False
    return bool(signature.bind(runner, *args, **kwargs).arguments.get("dummy_run"))


def record_blocks(worker: Worker, scheduler_output, resumed_replace: bool) -> None:
    """The step's block ids into the worker's copy: a new request's, a resumed one's (V1:
    ``resumed_req_ids``) in place of its old ones, a running one's appended."""
    for new in scheduler_output.scheduled_new_reqs:
        worker.blocks[new.req_id] = list(new.block_ids[0])
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids if resumed_replace else ()
    for req_id, ids in zip(cached.req_ids, cached.new_block_ids):
        if req_id in resumed:
            worker.blocks[req_id] = list(ids[0]) if ids is not None else []
        elif ids is not None:
            worker.blocks.setdefault(req_id, []).extend(ids[0])


# ---- V1 ----


def v1_update_states(orig):
    """Before the original: forget, cut, record the step's block ids."""

    @functools.wraps(orig)
    def wrapped(self, scheduler_output):
        worker = getattr(self, "_restkv", None)
        if worker is not None:
            cached = scheduler_output.scheduled_cached_reqs
            gone = set(scheduler_output.finished_req_ids) | set(cached.resumed_req_ids)
            gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
            worker.forget(gone)
            for req_id in list(worker.pending):
                edit = worker.cut(req_id)
                _v1_cut_row(self, req_id, *edit)
            record_blocks(worker, scheduler_output, resumed_replace=True)
        return orig(self, scheduler_output)

    return wrapped


def _v1_cut_row(runner, req_id: str, first: int, count: int) -> None:
    """Keep blocks ``first`` .. ``first + count - 1`` of the request's block ids and row."""
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


def v1_prepare_inputs(orig):
    """After the original: the step's batch; slots and sequence lengths of the entries held (the
    GPU lengths and the CPU bound FlashInfer reads)."""

    @functools.wraps(orig)
    def wrapped(self, scheduler_output, num_scheduled_tokens):
        out = orig(self, scheduler_output, num_scheduled_tokens)
        worker = getattr(self, "_restkv", None)
        if worker is not None:
            batch = self.input_batch
            n = batch.num_reqs
            computed, prompts = batch.num_computed_tokens_cpu[:n], batch.num_prompt_tokens[:n]
            worker.begin(batch.req_ids[:n], computed, num_scheduled_tokens[:n], prompts, self.device)
            if worker.request_offsets.any():
                offsets = worker.request_offsets
                self.seq_lens[:n] -= worker.request_offsets_device.to(self.seq_lens.dtype)
                bound = self.optimistic_seq_lens_cpu
                bound[:n] -= torch.from_numpy(offsets).to(bound.dtype)
                tokens = len(worker.token_offsets_device)
                held = self.positions[:tokens] - worker.token_offsets_device
                batch.block_table.compute_slot_mapping(n, self.query_start_loc.gpu[: n + 1], held)
        return out

    return wrapped


# ---- V2 ----


def forgetting(gone):
    """A V2 function after which the requests ``gone(scheduler_output)`` start afresh:
    ``finish_requests`` (finished and preempted ones), ``add_requests`` (V2 adds a resumed request
    again)."""

    def wrap(orig):
        @functools.wraps(orig)
        def wrapped(self, scheduler_output):
            worker = getattr(self, "_restkv", None)
            if worker is not None:
                worker.forget(gone(scheduler_output))
            return orig(self, scheduler_output)

        return wrapped

    return wrap


v2_finish_requests = forgetting(
    lambda out: set(out.finished_req_ids) | set(getattr(out, "preempted_req_ids", None) or ())
)
v2_add_requests = forgetting(lambda out: [new.req_id for new in out.scheduled_new_reqs])


def v2_update_requests(orig):
    """Before the original (whose new blocks then go after the kept ones): cut, record."""

    @functools.wraps(orig)
    def wrapped(self, scheduler_output):
        worker = getattr(self, "_restkv", None)
        if worker is not None:
            tables = self.block_tables
            for req_id in list(worker.pending):
                worker.cut(req_id)
                index = self.req_states.req_id_to_index.get(req_id)
                if index is None:
                    continue
                kept = worker.blocks[req_id]
                for group, table in enumerate(tables.block_tables):
                    table.stage_write(index, 0, kept)
                    tables.num_blocks.np[group, index] = len(kept)
            record_blocks(worker, scheduler_output, resumed_replace=False)
        return orig(self, scheduler_output)

    return wrapped


def v2_prepare_attn(orig):
    """After the original: the step's batch to the Worker; the slot mapping of the entries held,
    and their sequence lengths for the attention metadata (``v2_model_state_prepare_attn``)."""

    @functools.wraps(orig)
    def wrapped(self, input_batch):
        block_tables, slot_mappings = orig(self, input_batch)
        worker = getattr(self, "_restkv", None)
        if worker is None or CURRENT[0] is not worker:
            return block_tables, slot_mappings
        n = input_batch.num_reqs
        prompts = self.req_states.prompt_len.np[input_batch.idx_mapping_np[:n]]
        computed, counts = input_batch.num_computed_tokens_np[:n], input_batch.num_scheduled_tokens[:n]
        worker.begin(input_batch.req_ids[:n], computed, counts, prompts, self.device)
        worker.held_lengths = None
        if worker.request_offsets.any():
            tokens = len(worker.token_offsets_device)
            held = input_batch.positions[:tokens] - worker.token_offsets_device
            slot_mappings = self.block_tables.compute_slot_mappings(
                input_batch.idx_mapping,
                input_batch.query_start_loc,
                held,
                num_tokens_padded=input_batch.num_tokens_after_padding,
            )
            lengths = input_batch.seq_lens.clone()
            lengths[:n] -= worker.request_offsets_device.to(lengths.dtype)
            worker.held_lengths = (lengths, _minus(input_batch.seq_lens_cpu_upper_bound, worker.request_offsets))
        return block_tables, slot_mappings

    return wrapped


def _minus(bound, offsets: np.ndarray):
    """A CPU bound (a tensor or an array over the padded batch) minus the requests' offsets."""
    padded = np.zeros(len(bound), dtype=np.int64)
    padded[: len(offsets)] = offsets
    if isinstance(bound, torch.Tensor):
        return bound - torch.from_numpy(padded).to(bound.dtype)
    return bound - padded.astype(bound.dtype)


def v2_model_state_prepare_attn(orig):
    """The attention metadata built on the held sequence lengths of this step (the batch's own
    stay logical)."""

    @functools.wraps(orig)
    def wrapped(self, input_batch, *args, **kwargs):
        worker = CURRENT[0]
        held = None if worker is None else getattr(worker, "held_lengths", None)
        if held is not None:
            gpu, cpu = held
            input_batch = dataclasses.replace(input_batch, seq_lens=gpu, seq_lens_cpu_upper_bound=cpu)
        return orig(self, input_batch, *args, **kwargs)

    return wrapped
