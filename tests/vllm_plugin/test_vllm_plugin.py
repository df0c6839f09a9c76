"""The vLLM plugin (``restkv.vllm``) inside vLLM on the packaged SmolLM2, against plain vLLM and
restkv's transformers path, at vLLM's defaults (prefix caching and chunked prefill on).

Runs in the vLLM environment (``make vllm-test``); skipped where vLLM is not installed. Each engine
runs outside the test's process (``harness.engine_run``, eager unless a test says otherwise); restkv's
transformers path runs in restkv's own environment (``RESTKV_PYTHON``, default ``.venv/bin/python``)
through ``reference.py``.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness import (
    DECODING,
    H2O,
    PROMPT_LEN,
    RESTKV,
    SNAPKV,
    TP3_ENV,
    blocks,
    engine_run,
    one_after_another,
    reference,
)

pytestmark = pytest.mark.vllm


def test_budget_covering_the_prompt_gives_plain_vllm_tokens(model_dir, prompt):
    plain = engine_run(model_dir, [prompt], None)
    covered = engine_run(model_dir, [prompt], {**SNAPKV, "max_capacity_prompt": PROMPT_LEN})
    assert covered["tokens"] == plain["tokens"]
    assert covered["kept"] == [[]]  # nothing evicted
    assert covered["steps"] == plain["steps"]  # the same blocks held at every step


@pytest.mark.parametrize(
    "knobs",
    [pytest.param(SNAPKV, marks=pytest.mark.quick), RESTKV, H2O],
    ids=["snapkv", "restkv-paper", "h2o-summed"],
)
def test_chunked_prefill_eviction_matches_restkv_transformers_path(model_dir, prompt, knobs):
    """The prompt in chunks of 142 (the window split over the last two): every layer keeps the
    transformers path's positions and the tokens follow it."""
    ref = reference(prompt, knobs)
    run = engine_run(model_dir, [prompt], knobs)
    (kept,) = run["kept"][0]  # one tensor-parallel rank
    assert len(kept) == len(ref["kept"]) == 30
    for layer, (ours, theirs) in enumerate(zip(kept, ref["kept"])):
        assert ours == theirs, f"layer {layer}: kept positions differ"
    assert run["tokens"][0] == ref["tokens"]


def test_a_batch_and_a_prefix_hit(model_dir, text_ids, prompt):
    """Three requests in one batch (300 and 200 tokens over the budget, 100 under it), then a fourth
    sharing the first's first 256 tokens: each gives its own transformers-path tokens and kept
    positions; the fourth reads its first 256 tokens from the prefix cache (the first's 8 blocks,
    left whole by its eviction; the hit may reach 316 - 32, the window's queries)."""
    batch = [prompt, text_ids[350:550], text_ids[600:700]]
    later = text_ids[:256] + text_ids[700:760]
    run = engine_run(model_dir, [*batch, {"ids": later, "after": 0}], SNAPKV)
    for i, p in enumerate([*batch, later]):
        ref = reference(p, SNAPKV)
        assert run["tokens"][i] == ref["tokens"], f"request {i}"
        if len(p) > SNAPKV["max_capacity_prompt"]:
            assert run["kept"][i] == [ref["kept"]], f"request {i}"
    assert run["cached"][3] == 256
    assert run["cached"][:3] == [0, 0, 0]


def test_evicted_blocks_return_to_the_pool(model_dir, prompt):
    """With prefix caching the step that evicts holds the prompt's blocks and the 4 new ones its
    kept entries go to; after it, the 4 only; the prompt's blocks are back in the pool (free, and
    still cached)."""
    run = engine_run(model_dir, [prompt], SNAPKV)
    plain = engine_run(model_dir, [prompt], None)
    start = run["free_at_start"]
    last_chunk = next(i for i, (s, a) in enumerate(run["steps"]) if a != s)
    scheduled, after = run["steps"][last_chunk]
    kept = blocks(SNAPKV["max_capacity_prompt"])
    assert start - scheduled == blocks(PROMPT_LEN) + kept
    assert start - after == kept
    assert run["held"][0] == blocks(PROMPT_LEN) + kept
    assert start - plain["steps"][last_chunk][1] == blocks(PROMPT_LEN)  # plain vLLM holds them all
    assert start - run["steps"][last_chunk + 1][0] == blocks(SNAPKV["max_capacity_prompt"] + 1)


GENERATING = {"prompt-over-budget": (0, PROMPT_LEN), "prompt-under-budget": (PROMPT_LEN, 100)}  # (start, length)


@pytest.fixture(scope="module")
def generating(model_dir, text_ids) -> tuple:
    """(the plugin with ``DECODING``, plain vLLM): an engine each, serving ``GENERATING``'s prompts (no prefix
    shared) one after the other, 200 tokens each."""
    first, *more = [text_ids[start : start + n] for start, n in GENERATING.values()]
    prompts = [first, *({"ids": p} for p in more)]
    return engine_run(model_dir, prompts, DECODING, new_tokens=200), engine_run(model_dir, prompts, None, new_tokens=200)


@pytest.mark.parametrize("case", list(GENERATING))
def test_eviction_while_generating(generating, text_ids, case):
    """decode_interval=32 over 200 generated tokens: the transformers path's tokens, and a request
    never holds more than its budget plus the interval (plus the kept blocks of its first eviction,
    during that step)."""
    i = list(GENERATING).index(case)
    start, length = GENERATING[case]
    run, plain = generating
    ref = reference(text_ids[start : start + length], DECODING, 200)
    assert run["tokens"][i] == ref["tokens"]
    budget, interval = DECODING["max_capacity_prompt"], DECODING["decode_interval"]
    most = max(blocks(length), blocks(budget + interval)) + blocks(budget)
    assert run["held"][i] <= most
    assert plain["held"][i] == blocks(length + 200 - 1)
    assert run["steps"][-1][1] == run["free_at_start"]  # every block back at the end


TP_KNOBS = {"restkv": {**RESTKV, "decode_interval": 32}, "tova": {**SNAPKV, "method": "tova", "decode_interval": 32}}


@pytest.mark.both_cores
@pytest.mark.parametrize("method", list(TP_KNOBS))
def test_tensor_parallel_ranks_evict_their_own_heads(model_dir, text_ids, method):
    """TP=3 (one of SmolLM2's 3 KV heads per rank): each rank keeps the transformers path's positions
    for its head, with ReST-KV's W_O its own columns, TOVA's mean over every rank's heads (gathered:
    ``Observation.every_head``); the tokens are the transformers path's. One engine of ReST-KV's config
    serves both, TOVA's request with its own knobs, after ReST-KV's, on a prompt of its own."""
    prompts = [text_ids[:PROMPT_LEN], text_ids[50 : 50 + PROMPT_LEN]]
    requests = [(prompts[0], None), (prompts[1], TP_KNOBS["tova"])]
    runs = one_after_another(model_dir, TP_KNOBS["restkv"], requests, 64, TP3_ENV, tensor_parallel_size=3)
    i = list(TP_KNOBS).index(method)
    ref = reference(prompts[i], TP_KNOBS[method], 64)
    ranks = runs[i]["kept"]
    assert len(ranks) == 3
    for rank, kept in enumerate(ranks):
        for layer, (ours, theirs) in enumerate(zip(kept, ref["kept"])):
            assert ours == [theirs[rank]], f"rank {rank} layer {layer}"
    assert runs[i]["tokens"] == ref["tokens"]


def test_additional_config_without_the_environment_variable(model_dir, prompt):
    run = engine_run(model_dir, [prompt], None, additional_config={"restkv": SNAPKV})
    assert run["kept"][0] == [reference(prompt, SNAPKV)["kept"]]


def test_compiled_engine_at_every_default(model_dir, prompt):
    """No engine knob but the budget's: compiled model, vLLM's own chunk size (the prompt in one
    chunk), prefix caching on."""
    run = engine_run(model_dir, [prompt], SNAPKV, enforce_eager=False, max_num_batched_tokens=None)
    assert run["tokens"][0] == reference(prompt, SNAPKV)["tokens"]


@pytest.mark.quick
def test_refusals_at_startup_all_at_once(model_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from restkv.vllm import settings
    from restkv.vllm.hooks import install
    from restkv.vllm.hooks.refusals import refusals

    monkeypatch.setenv("RESTKV_VLLM", json.dumps({"method": "random", "max_capacity_prompt": 128}))
    install()
    args = dict(model=model_dir, dtype="float32", max_model_len=1024)
    config = EngineArgs(**args).create_engine_config()  # vLLM's defaults start
    config.scheduler_config.async_scheduling = True
    config.cache_config.cache_dtype = "fp8_per_token_head"  # scales per token and head: not read
    config.parallel_config.tensor_parallel_size = 3
    lines = refusals(config, settings.from_env())
    assert len(lines) == 3
    for line, words in zip(
        lines, ["--no-async-scheduling", "--tensor-parallel-size 1", "--kv-cache-dtype auto"]
    ):
        assert words in line and "=" in line and line.startswith("RESTKV_VLLM: ")
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        EngineArgs(**args, kv_cache_dtype="int8_per_token_head").create_engine_config()
