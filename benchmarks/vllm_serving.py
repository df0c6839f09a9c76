"""Serving throughput with the vLLM plugin: full cache vs eviction after prefill, at the same KV
memory.

The KV pool holds ``--pool_requests`` N full-length requests (prompt + new tokens); ``--requests`` M
long-prompt requests (default 4 N) are submitted at once. Each arm is one vLLM engine in a
subprocess (the plugin's overrides are process-wide): ``full`` is plain vLLM, ``evicted`` sets
``RESTKV_VLLM`` to the config. Printed per arm and as evicted / full ratios: requests/s, output
tokens/s, total tokens/s, the peak number of running requests, and preemptions. Run in the vLLM
environment (``make vllm-test`` sets it up):

    .venv-vllm/bin/python benchmarks/vllm_serving.py --prompt_len 2048 --new_tokens 128
    --pool_requests 4 \\
        --method snapkv --max_capacity_prompt 256

Timings need an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="a HF-format model folder (default: the packaged SmolLM2)"
    )
    p.add_argument("--prompt_len", type=int, default=2048)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument(
        "--pool_requests", type=int, default=4, help="N: the KV pool holds N full-length requests"
    )
    p.add_argument(
        "--requests", type=int, default=None, help="M requests submitted at once (default 4 N)"
    )
    p.add_argument(
        "--block_size", type=int, default=32, help="KV block size (a multiple of 32 on CPU)"
    )
    p.add_argument("--method", default="snapkv")
    p.add_argument("--max_capacity_prompt", type=int, default=256)
    p.add_argument("--window_size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--arm", choices=("full", "evicted"), help=argparse.SUPPRESS
    )  # one arm, in a subprocess
    args = p.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "pool_requests", "max_capacity_prompt", "window_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if args.requests is not None and args.requests < 1:
        raise ValueError("--requests must be >= 1")
    if args.block_size % 32:
        raise ValueError(
            f"--block_size must be a multiple of 32 on vLLM's CPU backend; got {args.block_size}"
        )
    if args.max_capacity_prompt >= args.prompt_len:
        raise ValueError(
            "--max_capacity_prompt must be smaller than --prompt_len (else nothing is evicted)"
        )
    return args


def knobs(args) -> dict:
    return {
        "method": args.method,
        "max_capacity_prompt": args.max_capacity_prompt,
        "window_size": args.window_size,
    }


def run_arm(args) -> dict:
    """One engine: submit every request at once, time them, count running requests and
    preemptions."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from restkv.bench.models import cache_dir

    model = args.model or str(cache_dir("smollm2-135m"))
    length = args.prompt_len + args.new_tokens
    llm = LLM(
        model=model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=length,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.pool_requests
        * -(-length // args.block_size)
        * _block_bytes(model, args),
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=length,
        max_num_seqs=max(256, args.requests),
        seed=0,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    counts = {"peak_running": 0, "preemptions": 0}
    _watch(scheduler, counts)
    g = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [
        {"prompt_token_ids": torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist()}
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "requests/s": len(outs) / seconds,
        "output tokens/s": new / seconds,
        "total tokens/s": (new + args.requests * args.prompt_len) / seconds,
        **counts,
        "pool blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
        "seconds": seconds,
    }


def _block_bytes(model: str, args) -> int:
    """Bytes of one KV block over every layer (keys and values)."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    return (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * head_dim
        * itemsize
        * args.block_size
    )


def _watch(scheduler, counts: dict) -> None:
    schedule, preempt = scheduler.schedule, scheduler._preempt_request

    def scheduled(*a, **k):
        out = schedule(*a, **k)
        counts["peak_running"] = max(counts["peak_running"], len(scheduler.running))
        return out

    def preempted(*a, **k):
        counts["preemptions"] += 1
        return preempt(*a, **k)

    scheduler.schedule, scheduler._preempt_request = scheduled, preempted


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.requests = args.requests or 4 * args.pool_requests
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args)))
        return {}
    results = {}
    for arm in ("full", "evicted"):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RESTKV_VLLM": json.dumps(knobs(args)) if arm == "evicted" else "",
        }
        cmd = [
            sys.executable,
            __file__,
            *(argv if argv is not None else sys.argv[1:]),
            "--arm",
            arm,
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the {arm} arm failed:\n{done.stderr[-3000:]}")
        results[arm] = json.loads(
            next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:]
        )
    report(args, results)
    return results


def report(args, results: dict) -> None:
    print(
        f"{args.requests} requests of {args.prompt_len} prompt + {args.new_tokens} new tokens; "
        f"KV pool for {args.pool_requests} full-length requests "
        f"({results['full']['pool blocks']} blocks of {args.block_size}); "
        f"evicted: {json.dumps(knobs(args))}"
    )
    names = ("requests/s", "output tokens/s", "total tokens/s", "peak_running", "preemptions")
    print(f"| {'':16} | {'full':>10} | {'evicted':>10} | {'evicted / full':>14} |")
    for name in names:
        full, ev = results["full"][name], results["evicted"][name]
        ratio = f"{ev / full:.2f}" if full else "-"
        print(f"| {name:16} | {full:10.3g} | {ev:10.3g} | {ratio:>14} |")


if __name__ == "__main__":
    main()
