"""One vLLM engine on the packaged SmolLM2 (in-process), greedy: tokens, kept positions and KV
blocks as JSON.

``python tests/vllm_plugin/run_engine.py '<spec json>'`` in the vLLM environment, with ``RESTKV_VLLM`` set
for the plugin (unset: plain vLLM). Spec: ``model`` (a HF-format folder), ``prompts`` (lists of
token ids), ``max_tokens``, ``block_size``, ``kv_tokens`` (the KV pool in tokens). Output: per
prompt its ``tokens`` and ``kept`` (per layer, per KV head, the kept positions; empty without
eviction), and ``steps``: the pool's free blocks ``[after scheduling, after the step's output]`` of
each engine step, and ``free_at_start``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
    "0"  # scheduler and worker in this process: their state is readable
)


def engine(spec: dict):
    from vllm import LLM

    head_bytes = (
        2 * 30 * 3 * 64 * 4
    )  # K and V, 30 layers, 3 KV heads, d 64, float32: bytes per token
    return LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024),
        block_size=spec.get("block_size", 32),
        kv_cache_memory_bytes=spec.get("kv_tokens", 4096) * head_bytes,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=spec.get("max_model_len", 1024),
        seed=0,
    )


def watch_blocks(scheduler, steps: list) -> None:
    """Record the pool's free blocks around each ``update_from_output`` (after scheduling, after the
    step)."""
    pool = scheduler.kv_cache_manager.block_pool
    update = scheduler.update_from_output

    def recorded(*args, **kwargs):
        before = pool.get_num_free_blocks()
        out = update(*args, **kwargs)
        steps.append([before, pool.get_num_free_blocks()])
        return out

    scheduler.update_from_output = recorded


def main(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = engine(spec)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    steps: list = []
    watch_blocks(core.scheduler, steps)
    free_at_start = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    state = getattr(runner, "_restkv", None)
    recorded = (
        {} if state is None else state.kept
    )  # by the engine's request id (the output's, plus a suffix)
    kept = [
        next((v for k, v in recorded.items() if k.rsplit("-", 1)[0] == o.request_id), {})
        for o in outs
    ]
    ranks = {} if state is None else state.rank
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "kept": [[k[n].tolist() for n in sorted(k, key=ranks.get)] for k in kept],
        "steps": steps,
        "free_at_start": free_at_start,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result))
