"""The V2 model runner's hooks (``vllm.v1.worker.gpu.model_runner``, the CUDA default).

- ``finish_requests`` / ``add_requests``: forget finished, preempted and re-added requests;
- ``update_requests``: cut the evicted group's rows evicted last step (a staged write and ``num_blocks``),
  record the new block ids;
- ``prepare_attn``: the slot mapping of the entries held (vLLM's own write of a request whose heads hold
  their own pages masked: slot -1), the step's batch to the ``Worker``;
- ``model_state_prepare_attn`` (``DefaultModelState.prepare_attn``): the attention metadata's
  sequence lengths of the entries held (the batch's own stay logical: the sampler reads them).
"""

from __future__ import annotations

import dataclasses
import functools

from .runner import CURRENT, record_blocks, shifted


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


finish_requests = forgetting(
    lambda out: set(out.finished_req_ids) | set(getattr(out, "preempted_req_ids", None) or ())
)
add_requests = forgetting(lambda out: [new.req_id for new in out.scheduled_new_reqs])


def update_requests(orig):
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
                tables.block_tables[worker.group].stage_write(index, 0, kept)
                tables.num_blocks.np[worker.group, index] = len(kept)
            record_blocks(worker, scheduler_output, resumed_replace=False)
        return orig(self, scheduler_output)

    return wrapped


def prepare_attn(orig):
    """After the original: the step's batch to the Worker; the slot mapping of the entries held,
    and their sequence lengths for the attention metadata (``model_state_prepare_attn``)."""

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
            logical = slot_mappings.clone() if len(slot_mappings) > 1 else None
            slot_mappings = self.block_tables.compute_slot_mappings(
                input_batch.idx_mapping,
                input_batch.query_start_loc,
                held,
                num_tokens_padded=input_batch.num_tokens_after_padding,
            )
            if logical is not None:  # a hybrid model's sliding windows keep their slots
                others = [g for g in range(len(logical)) if g != worker.group]
                slot_mappings[others] = logical[others]
            lengths = input_batch.seq_lens.clone()
            lengths[:n] -= worker.request_offsets_device.to(lengths.dtype)
            worker.held_lengths = (lengths, shifted(input_batch.seq_lens_cpu_upper_bound, -worker.request_offsets))
        if worker.flat_tokens is not None:  # their heads' pages are written by the plugin (``Worker.attend_heads``)
            slot_mappings[worker.group, worker.flat_tokens] = -1
        return block_tables, slot_mappings

    return wrapped


def model_state_prepare_attn(orig):
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
