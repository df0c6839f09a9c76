"""How the eviction step grows with the prompt: per method, step time and peak extra memory at several
lengths on one layer of Llama-3-8B's head geometry, with the growth exponent of each.

The step is ``restkv.eviction.select.select`` on a random layer (``compress_step.step_calls``: 32 query and 8
KV heads, head_dim 128, o_proj 4096 wide; ``--heads`` reduces the heads, as the output then says). Each
length runs in two fresh processes, one for time and one for memory (``compress_step.time_and_peak``: a
warm-up per method, the median of ``--reps`` calls; the peak extra memory of one call, on CUDA from the
allocator of ``--device``, on CPU from the resident set with a fixed glibc mmap threshold).

Per method: time and peak at each length, the growth exponent of each (the least-squares slope of log
value against log L: 1 is linear, 2 quadratic), and the peak as a multiple of the layer's K+V at the largest
length. Registered methods that need more than one layer (passes after the prefill, HeadKV's head table,
a cross-layer budget) are listed as such, not measured.

Usage::

    python benchmarks/scaling.py                       # L = 8K, 32K, 128K, every method
    python benchmarks/scaling.py --quick               # small lengths and heads (the test suite runs it)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import compress_step

# knobs whose work grows with the prompt on top of their method's (each measured as its own row)
VARIANTS = [
    "restkv:query_window={qw}",
    "restkv:metric_mode=before",
    "snapkv:refine_rounds=2",
    "snapkv:merge=pivot",
    "snapkv:merge=cam",
    "restkv:query_proxy=expected",
]
QUICK = dict(lengths=[1024, 2048, 4096], heads=(8, 2), budget=128, window=16, query_window=64)
FULL = dict(
    lengths=[8192, 32768, 131072],
    heads=(compress_step.HQ, compress_step.HKV),
    budget=1024,
    window=32,
    query_window=1024,
)


def specs(methods: list[str] | None, query_window: int) -> list[str]:
    """Every registered method (fullkv aside) and the variants, or ``methods``."""
    from restkv import METHODS

    if methods:
        return methods
    return [m for m in METHODS if m != "fullkv"] + [v.format(qw=query_window) for v in VARIANTS]


def one_layer(spec: str, budget: int, window: int) -> str | None:
    """Why ``spec`` cannot be measured on one layer (None: it can)."""
    from restkv.config import CompressionConfig
    from restkv.eviction.plans import is_deferred

    try:
        cfg = CompressionConfig.from_kwargs(
            max_capacity_prompt=budget, window_size=window, **compress_step.parse_method(spec)
        )
    except ValueError as e:
        return str(e).split(":")[0]
    if is_deferred(cfg):
        return "selects after every layer's prefill (passes or a cross-layer budget)"
    if cfg.get("head_budget") == "headkv":
        return "reads a model's head table"
    return None


def child(specs_: list[str], length: int, args, memory: bool) -> list[dict]:
    """Time or peak memory of every spec at ``length`` (in this process)."""
    import torch

    torch.set_num_threads(args.threads)
    calls, kv_bytes = compress_step.step_calls(
        specs_, length, args.budget, args.window, args.dtype, args.device, tuple(args.heads)
    )
    results = compress_step.time_and_peak(calls, args.reps, memory, device=args.device)
    return [{**r, "kv_bytes": kv_bytes} for r in results]


def run_child(specs_: list[str], length: int, args, memory: bool) -> list[dict]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(length),
        *specs_,
        "--budget",
        str(args.budget),
        "--window",
        str(args.window),
        "--dtype",
        args.dtype,
        "--reps",
        str(args.reps),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--heads",
        *map(str, args.heads),
    ]
    env = dict(os.environ)
    if memory:
        cmd.append("--memory")
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"scaling child at L={length} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def exponent(lengths: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) against log(L) (None when a value is not positive)."""
    if len(lengths) < 2 or min(values) <= 0:
        return None
    x = [math.log(n) for n in lengths]
    y = [math.log(v) for v in values]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def table(
    names: list[str], lengths: list[int], times: dict, peaks: dict, kv_bytes: dict
) -> list[dict]:
    """One row per method: its times, peaks, exponents and the multiple of the layer's K+V."""
    rows = []
    for i, name in enumerate(names):
        t = [times[n][i]["time"] for n in lengths]
        p = [peaks[n][i]["peak"] for n in lengths]
        rows.append(
            {
                "method": name,
                "time": t,
                "peak": p,
                "time_exp": exponent(lengths, t),
                "peak_exp": exponent(lengths, p),
                "multiple": p[-1] / kv_bytes[lengths[-1]],
            }
        )
    return rows


def fmt(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="L = 1K, 2K, 4K on 8/2 heads, budget 128, window 16"
    )
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument(
        "--heads",
        type=int,
        nargs=2,
        default=None,
        metavar=("QUERY", "KV"),
        help="heads of the layer (default Llama-3-8B's 32 8)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="method[:knob=value,...]; default every registered "
        "method and the knob variants that add work growing with L",
    )
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key in ("lengths", "heads", "budget", "window"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.heads[0] % args.heads[1]:
        raise ValueError(
            f"--heads: query heads ({args.heads[0]}) must be a multiple of KV heads ({args.heads[1]})"
        )
    if args.child:
        length, *names = args.child
        print(json.dumps(child(names, int(length), args, args.memory)))
        return None
    names, skipped = [], []
    for spec in specs(args.methods, preset["query_window"]):
        why = one_layer(spec, args.budget, args.window)
        (skipped.append((spec, why)) if why else names.append(spec))
    reduced = (
        ""
        if tuple(args.heads) == (compress_step.HQ, compress_step.HKV)
        else (f" (heads reduced from Llama-3-8B's {compress_step.HQ}/{compress_step.HKV})")
    )
    print(
        f"eviction step on one layer: {args.heads[0]} query / {args.heads[1]} KV heads{reduced}, head_dim "
        f"{compress_step.D}, {args.dtype}, budget {args.budget}, window {args.window}, {args.device}, "
        f"median of {args.reps}\n"
    )
    if not names:
        for spec, why in skipped:
            print(f"| {spec} | not measured on one layer: {why} |")
        return [], skipped
    times, peaks, kv_bytes = {}, {}, {}
    for n in args.lengths:
        times[n] = run_child(names, n, args, memory=False)
        peaks[n] = run_child(names, n, args, memory=True)
        kv_bytes[n] = times[n][0]["kv_bytes"]
    rows = table(names, args.lengths, times, peaks, kv_bytes)
    head = " | ".join(f"time L={n} (ms)" for n in args.lengths)
    mem = " | ".join(f"peak L={n} (MiB)" for n in args.lengths)
    print(
        f"| method | {head} | time exponent | {mem} | memory exponent | peak / layer K+V at L={args.lengths[-1]} |"
    )
    print("|---|" + "---|" * (2 * len(args.lengths) + 3))
    for r in rows:
        t = " | ".join(f"{x * 1e3:.1f}" for x in r["time"])
        m = " | ".join(f"{x / 2**20:.1f}" for x in r["peak"])
        print(
            f"| {r['method']} | {t} | {fmt(r['time_exp'])} | {m} | {fmt(r['peak_exp'])} | {r['multiple']:.2f} |"
        )
    for spec, why in skipped:
        print(f"| {spec} | not measured on one layer: {why} |")
    return rows, skipped


if __name__ == "__main__":
    main()
