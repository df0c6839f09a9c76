"""A step's outcome in restkv's vLLM path (``restkv.vllm.outcome``): one request's failed eviction is
contained to it, a fault that is not one request's stops the step on every rank, and the counts the
scheduler checks and puts on ``/metrics`` are what happened (through the paged engine of
``tests/vllm_sim.py``, the scheduler's side in tests/vllm_plugin/test_scheduler_side.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import on_ranks, prompt, small, tiny_model
from vllm_sim import Failed, PagedEngine

from restkv.config import CompressionConfig
from restkv.vllm.outcome import Kept, Outcome, merged, packed, unpacked
from restkv.vllm.worker import Worker

BUDGET = dict(max_capacity_prompt=40, window_size=8)
BROKEN = "model.layers.1.self_attn.attn"


def engine(knobs: dict, **kw) -> PagedEngine:
    return PagedEngine(tiny_model(attn_implementation="restkv_paged_sim"), knobs, **kw)


def broken(eng: PagedEngine, where: str) -> None:
    """``eng``'s worker raising in ``where`` (a method of it) for layer ``BROKEN``, or at the step's end."""
    orig = getattr(eng.worker, where)

    def raising(*args):
        if where in ("_conclude", "_pool") or args[0] == BROKEN:
            raise ValueError("injected")
        return orig(*args)

    setattr(eng.worker, where, raising)


@pytest.mark.parametrize(
    "method, where",
    [
        ("snapkv", "_evict"),  # a uniform budget's selection, in one layer
        ("h2o", "_add_chunk"),  # a summed method's chunk scores
        ("adakv", "_place"),  # per-head pages
        ("layer_defensivekv", "_score"),  # a budget shared across layers: its scores
        ("layer_defensivekv", "_conclude"),  # ... and its selection at the step's end
        ("adakv", "_pool"),  # the rule's pages, before the step runs
    ],
)
def test_a_failed_eviction_is_reported_and_the_next_request_runs_as_on_a_fresh_engine(method, where):
    """One request's eviction raising anywhere in the worker (one layer, the step's end, its rule): the
    step ends, the request is reported failed with the error and where it happened, nothing is left
    to cut; the same worker then serves the next request as a fresh engine does."""
    knobs = {**small(method), **BUDGET}
    ids = prompt(80)[0].tolist()
    eng = engine(knobs, chunk=13)
    broken(eng, where)
    with pytest.raises(Failed) as failed:
        eng.generate(ids, 3)
    message = str(failed.value)
    assert message.startswith("ValueError: injected (") and "tests/core/test_vllm_outcome.py" in message
    if where not in ("_conclude", "_pool"):
        assert f"in layer {BROKEN}" in message
    assert eng.worker.pending == {} and eng.worker.failed == {} and eng.worker.requests == {}
    setattr(eng.worker, where, getattr(Worker, where).__get__(eng.worker))
    other = prompt(70)[0].tolist()
    assert eng.generate(other, 4) == engine(knobs, chunk=13).generate(other, 4)


@pytest.mark.parametrize("knobs", [{"method": "snapkv"}, {"method": "simlayerkv"}, {"method": "pyramidkv"}])
@pytest.mark.parametrize("length", [30, 80])
def test_positions_dropped_are_counted_as_they_were_dropped(knobs, length):
    """``Kept.dropped``: the positions an eviction dropped over every layer and KV head, against a count of
    the kept positions each layer recorded (a threshold and PyramidKV's layers also on a prompt under the
    budget, where the held minus the budget would be negative); never below 0."""
    knobs = {**small(knobs["method"]), **knobs, **BUDGET}
    eng = engine(knobs)
    ids = prompt(length)[0].tolist()
    seen = []
    report = eng.worker.report
    eng.worker.report = lambda: seen.append(report()) or seen[-1]
    eng.generate(ids, 2)
    evicted = [o.kept["r"] for o in seen if "r" in o.kept]
    if not eng.recorded:
        assert evicted == []
        return
    (kept,) = evicted
    held = [(p >= 0).sum().item() for layer in eng.recorded["r"].values() for p in layer]
    assert kept.held == length and kept.heads == len(held)
    assert kept.dropped == sum(length - n for n in held) >= 0
    assert kept.evicted == pytest.approx(kept.dropped / kept.heads)


def test_outcomes_of_every_rank_merge_into_the_steps():
    """Every rank's outcome of a step (``merged``): a failure on any rank fails the request, a fault
    on any rank raises with that rank's message, counts that differ raise naming the request, and the
    positions dropped add up over the ranks' heads."""
    a, b = Kept(100, 40, 60 * 3, 3), Kept(100, 40, 50 * 3, 3)
    out = merged([Outcome({"x": a, "y": a}, seconds={"snapkv": 1.0}), Outcome({"x": b}, {"y": "boom"})])
    assert out.kept == {"x": Kept(100, 40, 330, 6)} and out.failed == {"y": "boom [tensor-parallel rank 1]"}
    assert out.seconds == {"snapkv": 1.0} and out.kept["x"].evicted == 55
    with pytest.raises(RuntimeError, match=r"layer broke \[tensor-parallel rank 1\]"):
        merged([Outcome({"x": a}), Outcome({"x": a}, fault="layer broke")])
    with pytest.raises(RuntimeError, match="request x's eviction differs between tensor-parallel ranks"):
        merged([Outcome({"x": a}), Outcome({"x": Kept(100, 41)})])
    with pytest.raises(RuntimeError, match="request x's eviction differs"):
        merged([Outcome({"x": a}), Outcome()])
    assert merged([Outcome({"x": a}, {"z": "why"})]) == Outcome({"x": a}, {"z": "why"})


@pytest.mark.parametrize("on_rank", ["failed", "fault"])
def test_what_one_rank_saw_reaches_every_rank_at_the_steps_end(on_rank):
    """Under tensor parallelism only one rank's output reaches the scheduler: a request failed on rank 1
    alone is reported failed by rank 0 too, and a fault on rank 1 alone stops rank 0's step with rank
    1's message (``Worker.end`` shares the step's outcome over the ranks)."""
    cfg = CompressionConfig.from_kwargs(**small("snapkv"), **BUDGET)

    def rank(ranks):
        worker = Worker(cfg, slots=2, caching=False, block_size=8)
        worker.ranks, worker.evicts = ranks, True  # a step with eviction work
        if ranks.rank == 1 and on_rank == "failed":
            worker.failed = {"x": "ValueError: rank one's"}
        if ranks.rank == 1 and on_rank == "fault":
            worker.fault = "restkv.vllm: layer broke"
        try:
            worker.end()
        except RuntimeError as e:
            return str(e)
        return worker.report().failed

    got = on_ranks(2, rank)
    if on_rank == "failed":
        assert got == [{"x": "ValueError: rank one's [tensor-parallel rank 1]"}] * 2
    else:
        assert got == ["restkv.vllm: layer broke [tensor-parallel rank 1]"] * 2


def test_a_fault_in_a_layer_stops_the_step_after_every_layer_ran():
    """A failure that is not one request's (the query ring's write) does not stop the layer's forward (the
    other ranks would wait for this one in the model's collectives); the step's end raises with it."""
    eng = engine({**small("snapkv"), **BUDGET})
    calls = []
    write = eng.worker.ring.write

    def failing(layer, *args):
        calls.append(layer)
        if layer == BROKEN:
            raise ValueError("ring")
        return write(layer, *args)

    eng.worker.ring.write = failing
    with pytest.raises(RuntimeError, match=f"ValueError: ring \\(layer {BROKEN} at"):
        eng.generate(prompt(20)[0].tolist(), 1)
    assert len(calls) == len(eng.names)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_a_stages_outcome_travels_whole_and_is_never_sliced_over_the_ranks(ranks):
    """A pipeline stage's outcome, as sent on with its hidden states: read back as it was, a CPU byte tensor
    whose length the tensor-parallel ranks never divide (vLLM would send it in slices and gather them over
    the device group, which a CPU tensor is not on)."""
    outcome = Outcome({"0-a": Kept(300, 128, 7740, 45)}, {"1-b": "RuntimeError: x (layer 3)"}, {"snapkv": 0.25})
    for pad in range(12):  # lengths around every multiple of the ranks
        o = Outcome(outcome.kept, {**outcome.failed, "2": "y" * pad}, outcome.seconds)
        tensor = packed(o, ranks)
        assert tensor.device.type == "cpu" and tensor.dtype == torch.uint8
        assert ranks == 1 or tensor.numel() % ranks != 0
        assert unpacked(tensor) == o
