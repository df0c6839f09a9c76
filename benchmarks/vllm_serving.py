"""Serving with the vLLM plugin: plain vLLM (full cache) against each method, at the same KV memory,
at vLLM's defaults (prefix caching and chunked prefill on).

Two workloads (``--workload``):

- ``prompts``: M requests of ``--prompt_len`` random tokens and ``--new_tokens`` generated, the KV
  pool sized for N (``--pool_requests``) of them at full length; the plugin evicts after the prompt.
- ``generation``: M short prompts each generating ``--new_tokens`` (thousands), the pool sized for
  N of them at full length; the plugin evicts every ``--decode_interval`` generated tokens.

Every arm is one engine in a subprocess (the plugin is process-wide), all requests submitted at
once, greedy. Printed per arm and as ratios to the full cache: requests/s, output tokens/s, total
tokens/s, output tokens per CPU second of the engine's process (the engine runs in it: a figure
that other jobs on the machine disturb less than wall time), the peak number of running requests,
preemptions, and the peak of blocks held (pool blocks minus free ones); for the evicting arms the time spent evicting, split into reading the
held entries back from the paged cache, selecting (scoring included) and writing the kept entries,
as seconds and as a share of the arm's wall time; on the CPU backend, every arm's attention kernel time,
vLLM's own calls apart from those of the plugin's per-head path (per-head and per-layer budgets: the
requests whose heads hold their own pages, attended flattened) and the rest of that path. On CUDA every clock is read after
``torch.cuda.synchronize()`` (the eviction's parts too), so a part counts the kernels it launched.
Run in the vLLM environment (``make vllm-install``), on an otherwise idle machine; docs/vllm.md gives
the commands of its figures.
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

from compress_step import parse_method  # noqa: E402  (benchmarks/, this script's folder)

METRICS = (
    "requests/s",
    "output tokens/s",
    "total tokens/s",
    "output tokens/CPU s",
    "peak running",
    "preemptions",
    "peak held blocks",
)
PARTS = ("read back", "select", "write")
ATTENTION = ("own kernel", "heads' kernel", "heads' rest")  # the CPU backend's attention, per path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a HF-format model folder (default: the packaged SmolLM2)")
    p.add_argument("--workload", choices=("prompts", "generation"), default="prompts")
    p.add_argument("--prompt_len", type=int, default=None, help="prompt tokens (default 1024; generation: 64)")
    p.add_argument("--new_tokens", type=int, default=None, help="tokens generated (default 64; generation: 2048)")
    p.add_argument("--pool_requests", type=int, default=2, help="N: the KV pool holds N full-length requests")
    p.add_argument("--requests", type=int, default=None, help="M requests submitted at once (default 8 N)")
    p.add_argument("--block_size", type=int, default=32, help="KV block size (a multiple of 32 on CPU)")
    p.add_argument(
        "--methods", nargs="+", default=["snapkv", "restkv"],
        help="restkv methods, one arm each: METHOD[:knob=value,...] (layer_defensivekv:value_norm=l2)",
    )
    p.add_argument("--max_capacity_prompt", type=int, default=128)
    p.add_argument("--window_size", type=int, default=32)
    p.add_argument("--decode_interval", type=int, default=None, help="default: 0 (prompts), 128 (generation)")
    p.add_argument("--max_num_batched_tokens", type=int, default=None, help="vLLM's chunk size (its default)")
    p.add_argument("--no_prefix_caching", action="store_true")
    p.add_argument("--no_chunked_prefill", action="store_true", help="the whole prompt in one step")
    p.add_argument("--enforce_eager", action="store_true", help="no compiled model")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--kv_cache_dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        help="every arm's KV cache (fp8: one byte an element, the pool's bytes for as many blocks)",
    )
    p.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in a subprocess
    args = p.parse_args(argv)
    generation = args.workload == "generation"
    args.prompt_len = args.prompt_len or (64 if generation else 1024)
    args.new_tokens = args.new_tokens or (2048 if generation else 64)
    args.decode_interval = (128 if generation else 0) if args.decode_interval is None else args.decode_interval
    args.requests = args.requests or 8 * args.pool_requests
    for name in ("prompt_len", "new_tokens", "pool_requests", "requests", "max_capacity_prompt", "window_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.block_size % 32:
        p.error(f"--block_size must be a multiple of 32 on vLLM's CPU backend; got {args.block_size}")
    if generation and not args.decode_interval:
        p.error("--workload generation evicts while generating: give --decode_interval > 0")
    if not generation and args.max_capacity_prompt >= args.prompt_len:
        p.error("--max_capacity_prompt must be smaller than --prompt_len (else nothing is evicted)")
    return args


def knobs(args, method: str) -> dict:
    """An arm's knobs: ``METHOD[:knob=value,...]`` (``compress_step.parse_method``) at the budget flags."""
    out = {"max_capacity_prompt": args.max_capacity_prompt, "window_size": args.window_size, **parse_method(method)}
    if args.decode_interval:
        out["decode_interval"] = args.decode_interval
    return out


def run_arm(args) -> dict:
    """One engine: every request at once; timings, running requests, preemptions, blocks held."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from restkv.integration.models import cache_dir

    now = clock()
    timers = _time_eviction(now) if args.arm != "full" else None
    attention = _time_attention(now) if not torch.cuda.is_available() else None
    model = args.model or str(cache_dir("smollm2-135m"))
    length = args.prompt_len + args.new_tokens
    chunk = args.max_num_batched_tokens or (length if args.no_chunked_prefill else None)
    extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=length,
        block_size=args.block_size,
        kv_cache_memory_bytes=(args.pool_requests * -(-length // args.block_size) + 1) * _block_bytes(model, args),
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=max(256, args.requests),
        seed=0,
        **extra,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    counts = {"peak running": 0, "preemptions": 0, "peak held blocks": 0}
    _watch(scheduler, counts)
    g = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [
        {"prompt_token_ids": torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist()}
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    start, cpu = now(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = now() - start, time.process_time() - cpu
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "requests/s": len(outs) / seconds,
        "output tokens/s": new / seconds,
        "total tokens/s": (new + args.requests * args.prompt_len) / seconds,
        "output tokens/CPU s": new / cpu,
        **counts,
        "pool blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
        "seconds": seconds,
        **({} if timers is None else dict(timers)),
        **({} if attention is None else dict(attention)),
    }


def clock():
    """The wall clock in seconds: on CUDA read after ``torch.cuda.synchronize()`` (the GPU's queued
    work counted), on CPU ``time.perf_counter`` itself."""
    import torch

    if not torch.cuda.is_available():
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return now


def _time_eviction(now) -> dict:
    """Accumulate the worker's eviction time in its three parts (seconds of ``now``)."""
    from restkv.vllm import layer_eviction, paged, worker

    timers = dict.fromkeys(PARTS, 0.0)

    def timed(owner, name, part):
        orig = getattr(owner, name)

        def run(*a, **k):
            t = now()
            try:
                return orig(*a, **k)
            finally:
                timers[part] += now() - t

        setattr(owner, name, run)

    timed(paged.Paged, "read", "read back")
    timed(paged.Paged, "read_pages", "read back")  # per-head budgets while decoding: the heads' pages
    timed(layer_eviction, "kept_entries", "select")  # where a request's eviction in a layer calls them
    timed(layer_eviction, "chunk_score", "select")
    timed(layer_eviction, "entry_scores", "select")  # a budget shared across layers: each layer's scores,
    timed(layer_eviction, "shared_sizes", "select")  # then the shares
    timed(paged.Paged, "write", "write")
    timed(worker.Worker, "_place", "write")  # per-head and per-layer budgets: the kept entries on their pages
    return timers


def _time_attention(now) -> dict:
    """Accumulate the CPU backend's attention kernel (``cpu_attention_with_kv_cache``), split into
    vLLM's own calls and those of the plugin's per-head path (``Worker.attend_heads``: the requests
    whose heads hold their own pages, flattened), and the rest of that path (its writes, copies and
    metadata), in seconds of ``now``."""
    from vllm import _custom_ops as ops

    from restkv.vllm import worker

    timers = dict.fromkeys(ATTENTION, 0.0)
    inside = [False]
    kernel, heads = ops.cpu_attention_with_kv_cache, worker.Worker.attend_heads

    def timed_kernel(*a, **k):
        t = now()
        try:
            return kernel(*a, **k)
        finally:
            timers["heads' kernel" if inside[0] else "own kernel"] += now() - t

    def timed_heads(*a, **k):
        t, before = now(), timers["heads' kernel"]
        inside[0] = True
        try:
            return heads(*a, **k)
        finally:
            inside[0] = False
            timers["heads' rest"] += now() - t - (timers["heads' kernel"] - before)

    ops.cpu_attention_with_kv_cache, worker.Worker.attend_heads = timed_kernel, timed_heads
    return timers


def _block_bytes(model: str, args) -> int:
    """Bytes of one KV block over every layer (keys and values) in the KV cache's dtype."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    fp8 = getattr(args, "kv_cache_dtype", "auto").startswith("fp8")  # vllm_bench_serve.py's arms: the model's
    itemsize = 1 if fp8 else {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * itemsize * args.block_size


def _watch(scheduler, counts: dict) -> None:
    schedule, preempt = scheduler.schedule, scheduler._preempt_request
    pool = scheduler.kv_cache_manager.block_pool

    def scheduled(*a, **k):
        out = schedule(*a, **k)
        counts["peak running"] = max(counts["peak running"], len(scheduler.running))
        held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # the null block aside
        counts["peak held blocks"] = max(counts["peak held blocks"], held)
        return out

    def preempted(*a, **k):
        counts["preemptions"] += 1
        return preempt(*a, **k)

    scheduler.schedule, scheduler._preempt_request = scheduled, preempted


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args)))
        return {}
    results = {}
    for arm in ("full", *args.methods):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RESTKV_VLLM": "" if arm == "full" else json.dumps(knobs(args, arm)),
        }
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--arm", arm], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"the {arm} arm failed:\n{done.stderr[-3000:]}")
        results[arm] = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])
    report(args, argv, results)
    return results


def report(args, argv, results: dict) -> None:
    print(f"python benchmarks/vllm_serving.py {' '.join(argv)}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(
        f"{args.workload}: {args.requests} requests of {args.prompt_len} prompt + {args.new_tokens} new tokens; "
        f"KV pool for {args.pool_requests} full-length requests ({results['full']['pool blocks']} blocks "
        f"of {args.block_size}, vLLM's null block one of them); budget {args.max_capacity_prompt}, window {args.window_size}, "
        f"decode_interval {args.decode_interval}; prefix caching {'off' if args.no_prefix_caching else 'on'}, "
        f"chunked prefill {'off' if args.no_chunked_prefill else 'on'}{', eager' if args.enforce_eager else ''}; "
        f"{args.dtype}, KV cache {args.kv_cache_dtype}"
    )
    arms = list(results)
    print("| | " + " | ".join(arms) + " | " + " | ".join(f"{m} / full" for m in arms[1:]) + " |")
    print("|---" * (2 * len(arms)) + "|")
    for name in METRICS:
        row = [results[a][name] for a in arms]
        ratios = [f"{v / row[0]:.2f}" if row[0] else "-" for v in row[1:]]
        print(f"| {name} | " + " | ".join(f"{v:.3g}" for v in row) + " | " + " | ".join(ratios) + " |")
    print()
    print("| eviction (s, share of wall time) | " + " | ".join(PARTS) + " | all |")
    print("|---" * (len(PARTS) + 2) + "|")
    for arm in arms[1:]:
        r = results[arm]
        parts = [r[p] for p in PARTS]
        cells = [f"{s:.2f} ({s / r['seconds']:.1%})" for s in parts + [sum(parts)]]
        print(f"| {arm} | " + " | ".join(cells) + " |")
    if all(p in results[a] for a in arms for p in ATTENTION):
        print()
        print("| attention on the CPU backend (s, share of wall time) | " + " | ".join(ATTENTION) + " |")
        print("|---" * (len(ATTENTION) + 1) + "|")
        for arm in arms:
            r = results[arm]
            print(f"| {arm} | " + " | ".join(f"{r[p]:.2f} ({r[p] / r['seconds']:.1%})" for p in ATTENTION) + " |")


if __name__ == "__main__":
    main()
