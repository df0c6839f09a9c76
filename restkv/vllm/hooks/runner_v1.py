"""The V1 model runner's hooks (``vllm.v1.worker.gpu_model_runner``: the CPU backend's, and CUDA's with
``VLLM_USE_V2_MODEL_RUNNER=0``).

- ``update_states`` (``_update_states``): forget finished, preempted and resumed requests, cut the
  rows evicted last step (``req_state.block_ids`` and the block table's numpy row), record the
  step's new block ids;
- ``prepare_inputs`` (``_prepare_inputs``): slots and sequence lengths of the entries held (the GPU
  lengths and the CPU bound FlashInfer reads), the step's batch to the ``Worker``; the slots of the
  evicted group only (a hybrid model's sliding windows keep theirs, and their lengths:
  ``runner.build_metadata``).
"""

from __future__ import annotations

import functools

import torch

from .. import settings
from .runner import record_blocks


def update_states(orig):
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
                cut_row(self, req_id, worker.cut(req_id))
            record_blocks(worker, scheduler_output, resumed_replace=True)
        return orig(self, scheduler_output)

    return wrapped


def cut_row(runner, req_id: str, e: settings.Eviction) -> None:
    """Cut the request's block ids and block-table row of the evicted group (``Worker.group``) as ``e`` cuts
    a request's blocks."""
    req_state = runner.requests.get(req_id)
    row = runner.input_batch.req_id_to_index.get(req_id)
    group = runner._restkv.group
    table = runner.input_batch.block_table.block_tables[group]
    if req_state is not None:
        e.cut(req_state.block_ids[group])
    if row is not None:
        held = table.num_blocks_per_row[row]
        ids = table.block_table.np[row, :held].tolist()
        e.cut(ids)
        table.block_table.np[row, : len(ids)] = ids
        table.block_table.np[row, len(ids) : held] = 0
        table.num_blocks_per_row[row] = len(ids)


def prepare_inputs(orig):
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
                table = batch.block_table.block_tables[worker.group]  # a sliding window's stay logical
                table.compute_slot_mapping(n, self.query_start_loc.gpu[: n + 1], held)
            if worker.flat_tokens is not None:  # their heads' pages are written by the plugin
                batch.block_table.block_tables[worker.group].slot_mapping.gpu[worker.flat_tokens] = -1
        return out

    return wrapped
