"""One engine serving scenarios of requests that run together, stepped one engine step at a time
(``python concurrent_run.py SPEC``, in a subprocess: the plugin's config is process-wide; prints
``RESULT {...}``).

SPEC: ``benchmarks/vllm_check.py``'s engine spec (``model``, ``kv_tokens``, vLLM keywords) and
``scenarios``: lists of requests ``{"ids": [...], "max_tokens": n, "at": step}``, each added before
the scenario's engine step ``at``. Each scenario starts on an empty prefix cache and runs until
its requests finish. Per scenario: ``tokens`` and ``cached`` (prompt tokens a prefix hit gave it)
per request, ``free_at_start`` / ``free_at_end`` (the pool's free blocks), ``left`` (requests
the scheduler still holds), and per engine step ``scheduled`` ({request: tokens}), ``evicting``
({request: how many of its blocks another request also held when it evicted}) and ``free``
([after scheduling, after the step]).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from vllm_check import engine, script_result  # noqa: E402


def in_subprocess(spec: dict, knobs: dict | None) -> list:
    """``run(spec)`` in a fresh process, ``knobs`` through ``RESTKV_VLLM`` (None: plain vLLM)."""
    return script_result([__file__, json.dumps(spec)], knobs)


def watch(scheduler, steps: list, index: dict) -> None:
    """Record each step around ``update_from_output`` (``index``: engine request id -> request)."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    update = scheduler.update_from_output
    per_request = manager.coordinator.single_type_managers[0].req_to_blocks

    def recorded(output, *args, **kwargs):
        due = getattr(manager, "_restkv", None)
        due = {} if due is None else due.evictions(output)
        scheduled = {index[r]: n for r, n in output.num_scheduled_tokens.items()}
        evicting = {
            index[r]: sum(b.ref_cnt > 1 for b in per_request.get(r, []))
            for r in output.num_scheduled_tokens
            if r in due
        }
        before = pool.get_num_free_blocks()
        out = update(output, *args, **kwargs)
        free = [before, pool.get_num_free_blocks()]
        steps.append({"scheduled": scheduled, "evicting": evicting, "free": free})
        return out

    scheduler.update_from_output = recorded


def run(spec: dict) -> list:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    llm = engine(spec)
    core = llm.llm_engine.engine_core.engine_core
    scheduler, pool = core.scheduler, core.scheduler.kv_cache_manager.block_pool
    results = []
    for n, scenario in enumerate(spec["scenarios"]):
        assert llm.reset_prefix_cache(), "the prefix cache did not reset"
        steps: list = []
        index: dict = {}
        watch(scheduler, steps, index)
        free_at_start = pool.get_num_free_blocks()
        outputs: dict = {}
        step = 0
        while len(outputs) < len(scenario):
            for i, request in enumerate(scenario):
                if request["at"] == step:
                    params = SamplingParams(
                        max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True
                    )
                    rid = llm.llm_engine.add_request(
                        f"s{n}r{i}", {"prompt_token_ids": request["ids"]}, params
                    )
                    index[rid] = i
            for out in llm.llm_engine.step():
                if out.finished:
                    outputs[int(out.request_id.split("-")[0].rsplit("r", 1)[1])] = out
            step += 1
            assert step < 20_000, "the scenario did not finish"
        del scheduler.update_from_output
        results.append(
            {
                "tokens": [list(outputs[i].outputs[0].token_ids) for i in range(len(scenario))],
                "cached": [outputs[i].num_cached_tokens or 0 for i in range(len(scenario))],
                "steps": steps,
                "free_at_start": free_at_start,
                "free_at_end": pool.get_num_free_blocks(),
                "left": len(scheduler.requests) + len(scheduler.running) + len(scheduler.waiting),
            }
        )
    return results


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))))
