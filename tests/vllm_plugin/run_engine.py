"""One vLLM engine on the packaged SmolLM2 (engine core in-process), greedy: tokens, kept positions
and KV blocks as JSON.

``python tests/vllm_plugin/run_engine.py '<spec json>'`` in the vLLM environment, with ``RESTKV_VLLM``
set for the plugin (unset: plain vLLM). Spec: ``model`` (a HF-format folder), ``prompts`` (lists of
token ids, or ``{"ids": [...], "after": i}`` to submit it once prompt i has finished), ``max_tokens``,
``block_size``, ``kv_tokens`` (the KV pool in tokens), and vLLM's own ``enable_prefix_caching``,
``enable_chunked_prefill``, ``max_num_batched_tokens``, ``tensor_parallel_size``,
``additional_config``, ``enforce_eager`` (its defaults otherwise). Output: per prompt its ``tokens`` and ``kept`` (per
layer, per KV head, the positions its first eviction kept, from every tensor-parallel rank: one
list per rank; empty without eviction), ``steps`` (the pool's free blocks ``[after scheduling,
after the step]`` of each engine step), ``free_at_start``, ``held`` (the most blocks a request held
at once, per prompt) and ``cached`` (its prompt tokens a prefix-cache hit provided).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
    "0"  # the scheduler in this process: its state is readable
)


def engine(spec: dict):
    from vllm import LLM

    head_bytes = (
        2 * 30 * 3 * 64 * 4
    )  # K and V, 30 layers, 3 KV heads, d 64, float32: bytes per token
    tp = spec.get("tensor_parallel_size", 1)
    own = {
        k: spec[k]
        for k in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "max_num_batched_tokens",
            "additional_config",
            "enforce_eager",
        )
        if k in spec
    }
    return LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=spec.get("max_model_len", 1024),
        block_size=spec.get("block_size", 32),
        kv_cache_memory_bytes=spec.get("kv_tokens", 4096) * head_bytes // tp,
        tensor_parallel_size=tp,
        seed=0,
        **own,
    )


def watch_blocks(scheduler, steps: list, held: dict) -> None:
    """Record the pool's free blocks around each ``update_from_output`` (after scheduling, after the
    step), and the most blocks each request held after scheduling."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    update = scheduler.update_from_output

    def recorded(*args, **kwargs):
        before = pool.get_num_free_blocks()
        for req_id in args[0].num_scheduled_tokens:
            blocks = manager.coordinator.single_type_managers[0].req_to_blocks.get(req_id, [])
            held[req_id] = max(held.get(req_id, 0), len(blocks))
        out = update(*args, **kwargs)
        steps.append([before, pool.get_num_free_blocks()])
        return out

    scheduler.update_from_output = recorded


def kept_on_worker(worker) -> dict:
    """The runner's recorded kept positions: {request id: {layer rank: [Hkv][B]}}."""
    runner = worker.model_runner
    state = getattr(runner, "_restkv", None)
    if state is None:
        return {}
    return {
        req: {state.rank[name]: positions.tolist() for name, positions in layers.items()}
        for req, layers in state.kept.items()
    }


def main(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = engine(spec)
    core = llm.llm_engine.engine_core.engine_core
    steps: list = []
    held: dict = {}
    watch_blocks(core.scheduler, steps, held)
    free_at_start = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    waves: list = [[]]
    for p in spec["prompts"]:
        if isinstance(p, dict):
            waves.append([p["ids"]])
        else:
            waves[0].append(p)
    outs = []
    for wave in waves:
        outs += llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
    ranks = llm.collective_rpc(kept_on_worker)
    kept = []
    for o in outs:
        per_rank = [
            next((v for k, v in r.items() if k.rsplit("-", 1)[0] == o.request_id), {})
            for r in ranks
        ]
        kept.append([[r[i] for i in sorted(r)] for r in per_rank] if per_rank[0] else [])
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "kept": kept,
        "steps": steps,
        "free_at_start": free_at_start,
        "held": [
            next((v for k, v in held.items() if k.rsplit("-", 1)[0] == o.request_id), 0)
            for o in outs
        ],
        "cached": [o.num_cached_tokens or 0 for o in outs],
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result))
