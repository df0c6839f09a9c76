"""Inside vLLM: ``restkv.vllm.capacity``'s answer is what the engine does, and each worker says in
one start-up line what the plugin will do (``restkv.vllm.startup``).

Each engine runs in a subprocess (``python THIS_FILE MODE``: ``plugin`` or ``plain``), the packaged
SmolLM2 in float32 on vLLM's CPU backend at its defaults (prefix caching, chunked prefill of CHUNK
tokens a step) with an explicit pool of POOL blocks, and gets REQUESTS distinct prompts of PROMPT
tokens, OUTPUT generated each (``ignore_eos``), all at once. A recorder around the scheduler's
``schedule`` counts the requests running after each step is scheduled and the blocks each holds
(in its prompt's steps and after), and the preemptions.

The sizes make the answer exact, not a bound: with the plugin (B=128, 4 blocks) a request holds
9 + 4 blocks in its prompt's last step, then 4, and 5 from its next step on (128 + 32 entries: the
33rd token is never written), so 3 run at once in 23 blocks (2 x 5 + 13) and a fourth's prompt (9
blocks) never finds room; plain vLLM holds 9, then 10 blocks (288 + 32), so 2 run at once.

The same for Gemma 3 270M (``gemma3`` modes: 3 layers a block, one full-attention KV cache group and five
sliding of 512 tokens, the blocks a request holds counted in every group, vLLM's freed ones not), prompts
of GEMMA_PROMPT tokens in chunks of GEMMA_CHUNK: with the plugin a request peaks at 136 blocks in its prompt
and holds 90 after it (5 + 5 x 17), so 3 run at once in GEMMA_POOL - 1 = 330 blocks; plain vLLM 108 (23 + 5 x
17), so 2.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from vllm_check import script_result  # noqa: E402
KNOBS = {"method": "snapkv", "max_capacity_prompt": 128, "window_size": 32}
PROMPT, OUTPUT, REQUESTS = 288, 33, 4  # REQUESTS: more than either engine runs at once
BLOCK, CHUNK, POOL, MAX_LEN = 32, 142, 24, 512  # POOL: blocks, vLLM's null block one of them


GEMMA_PROMPT, GEMMA_CHUNK, GEMMA_POOL, GEMMA_MAX_LEN = 700, 256, 331, 1024
SIZES = {  # model: (its folder's name, prompt, chunk, pool blocks, max_model_len, a block's bytes)
    "smollm2": ("smollm2-135m", PROMPT, CHUNK, POOL, MAX_LEN, BLOCK * 30 * 2 * 3 * 64 * 4),  # 30 layers, 3 KV heads of 64
    "gemma3": ("gemma3-270m", GEMMA_PROMPT, GEMMA_CHUNK, GEMMA_POOL, GEMMA_MAX_LEN, BLOCK * 3 * 2 * 1 * 256 * 4),
}


def _engine(mode: str, model: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from restkv.integration.models import cache_dir

    name, prompt_len, chunk, pool, max_len, block_bytes = SIZES[model]
    extra = {"additional_config": {"restkv": KNOBS}} if mode == "plugin" else {}
    llm = LLM(
        model=str(cache_dir(name)), dtype="float32", enforce_eager=True, seed=0,
        block_size=BLOCK, max_model_len=max_len, max_num_batched_tokens=chunk,
        kv_cache_memory_bytes=pool * block_bytes, **extra,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers

    def held(rid) -> int:  # every group's blocks, less those vLLM freed out of a sliding window
        return sum(sum(not b.is_null for b in m.req_to_blocks.get(rid, ())) for m in managers)

    seen = {"running": 0, "prompt": 0, "after": 0, "preempted": 0}
    schedule, preempt = scheduler.schedule, scheduler._preempt_request

    @functools.wraps(schedule)
    def scheduled(*args, **kwargs):
        out = schedule(*args, **kwargs)
        seen["running"] = max(seen["running"], len(scheduler.running))
        for rid, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]  # its computed tokens already count this step's
            prompt = request.num_computed_tokens - n < request.num_prompt_tokens
            phase = "prompt" if prompt else "after"
            seen[phase] = max(seen[phase], held(rid))
        return out

    def preempted(*args, **kwargs):
        seen["preempted"] += 1
        return preempt(*args, **kwargs)

    scheduler.schedule, scheduler._preempt_request = scheduled, preempted
    ids = [[100 + (i * 997 + j * 31) % 40000 for j in range(prompt_len)] for i in range(REQUESTS)]
    prompts = [{"prompt_token_ids": x} for x in ids]  # distinct from their first block: no hits
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [OUTPUT] * REQUESTS
    config = llm.llm_engine.vllm_config
    seen.update(
        blocks=config.cache_config.num_gpu_blocks,
        caching=bool(config.cache_config.enable_prefix_caching),
        max_num_seqs=config.scheduler_config.max_num_seqs,
    )
    print("RESULT " + json.dumps(seen))


def _run(mode: str, model: str = "smollm2") -> dict:
    return script_result([__file__, mode, model], None, log="restkv: ")


@pytest.fixture(scope="module")
def runs() -> dict:
    pytest.importorskip("vllm")
    return {mode: _run(mode) for mode in ("plugin", "plain")}


@pytest.fixture(scope="module")
def gemma_runs() -> dict:
    pytest.importorskip("vllm")
    from restkv.integration.models import cache_dir

    if not (cache_dir("gemma3-270m") / "config.json").is_file():
        pytest.skip("no Gemma 3 270M folder")
    return {mode: _run(mode, "gemma3") for mode in ("plugin", "plain")}


def _answer(run: dict, model: str = "smollm2"):
    from restkv.integration.models import cache_dir
    from restkv.vllm import capacity

    name, prompt_len, chunk, pool, max_len, block_bytes = SIZES[model]
    return capacity.capacity(
        str(cache_dir(name)), pool * block_bytes, max_len, KNOBS, prompt_len, OUTPUT, run["max_num_seqs"], BLOCK,
        max_num_batched_tokens=chunk, dtype="float32", prefix_caching=run["caching"],
    )


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["plugin", "plain"])
def test_the_engine_runs_as_many_at_once_as_the_answer(runs, mode):
    """Peak running requests, blocks a request holds in its prompt and after it: the tool's, with
    nothing preempted (each of the answer's requests runs at its largest to the end)."""
    run = runs[mode]
    c = _answer(run)
    arm = c.plugin if mode == "plugin" else c.plain
    assert run["blocks"] == POOL == arm.blocks + 1
    assert (run["prompt"], run["after"]) == (arm.holding.prompt, arm.holding.largest)
    assert run["running"] == arm.at_once == {"plugin": 3, "plain": 2}[mode]
    assert run["preempted"] == 0


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["plugin", "plain"])
def test_a_hybrid_engine_runs_as_many_at_once_as_the_answer(gemma_runs, mode):
    """Gemma 3 270M: as the SmolLM2 test, every KV cache group's blocks counted (a block: 3 layers)."""
    run = gemma_runs[mode]
    c = _answer(run, "gemma3")
    arm = c.plugin if mode == "plugin" else c.plain
    assert c.block_bytes == SIZES["gemma3"][-1] and run["blocks"] == GEMMA_POOL == arm.blocks + 1
    assert (run["prompt"], run["after"]) == (arm.holding.prompt, arm.holding.largest)
    assert run["running"] == arm.at_once == {"plugin": 3, "plain": 2}[mode]
    assert run["preempted"] == 0


@pytest.mark.vllm
def test_one_start_up_line_says_what_the_plugin_does(runs):
    """Its config, backend and runner; plain vLLM's worker: that the plugin is off."""
    from restkv.config import CompressionConfig
    from restkv.vllm import startup

    line = startup.line(CompressionConfig.from_kwargs(**KNOBS), ["CPU_ATTN"], "V1")
    assert line == (
        "restkv: snapkv max_capacity_prompt=128 window_size=32 decode_interval=0; "
        "backend CPU_ATTN; runner V1"
    )
    assert [x for x in runs["plugin"]["log"] if x.startswith("restkv: snapkv")] == [line]
    assert [x for x in runs["plain"]["log"] if x.startswith("restkv: off")] == [startup.OFF]
    assert runs["plain"]["log"] == [startup.OFF]  # nothing else from the plugin when it is off


if __name__ == "__main__":
    _engine(*sys.argv[1:])
