"""How the eviction step grows with the prompt: per method, step time and peak extra memory at several
lengths on one layer of Llama-3-8B's head geometry, with the growth exponent of each.

The step is ``restkv.eviction.select.select`` on a random layer (``compress_step.step_calls``: 32 query and 8
KV heads, head_dim 128, o_proj 4096 wide; ``--heads`` reduces the heads, as the output then says). Each
length runs in two fresh processes, one for time and one for memory (``compress_step.time_and_peak``: a
warm-up per method, the median of ``--reps`` calls; the peak extra memory of one call, on CUDA from the
allocator of ``--device``, on CPU from the resident set with a fixed glibc mmap threshold).

Per method: time and peak at each length, the growth exponent of each (the least-squares slope of log
value against log L: 1 is linear, 2 quadratic), and the peak as a multiple of the layer's K+V at the largest
length. HeadKV's head table is random (the layer's per-head budgets from a random importance table).

The methods whose selection waits for every layer's prefill (passes after the prefill such as KVzip's, a
cross-layer budget) are measured on a random model of ``--layers`` layers of the same head geometry
(``model_prefill``: a small MLP, an unchunked prefill of random ids) at ``--model-lengths``: the peak
extra memory of the prefill with the method over the same prefill with the full cache, in one fresh
process per length, its growth exponent, and its multiple of one layer's and of the whole model's K+V at
the largest length; with the time of that prefill as a multiple of the full cache's.

Usage::

    python benchmarks/scaling.py                       # L = 8K, 32K, 128K, every method
    python benchmarks/scaling.py --quick               # small lengths and heads (the test suite runs it)
    python benchmarks/scaling.py --heads 8 2 --methods kvzip kvgrad   # deferred ones: on a 2-layer model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import compress_step
import model_prefill

# knobs whose work grows with the prompt on top of their method's (each measured as its own row)
VARIANTS = [
    "restkv:query_window={qw}",
    "restkv:metric_mode=before",
    "snapkv:refine_rounds=2",
    "snapkv:merge=pivot",
    "snapkv:merge=cam",
    "restkv:query_proxy=expected",
]
QUICK = dict(
    lengths=[1024, 2048, 4096],
    model_lengths=[1024, 2048, 4096],
    heads=(8, 2),
    budget=128,
    window=16,
    query_window=64,
)
FULL = dict(
    lengths=[8192, 32768, 131072],
    model_lengths=[8192, 16384, 32768],
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


DEFERRED = "selects after every layer's prefill (passes or a cross-layer budget)"


def one_layer(spec: str, budget: int, window: int) -> str | None:
    """Why ``spec`` cannot be measured on one layer (None: it can; ``DEFERRED``: on a model)."""
    from restkv.config import CompressionConfig
    from restkv.eviction.plans import is_deferred

    try:
        cfg = CompressionConfig.from_kwargs(
            max_capacity_prompt=budget, window_size=window, **compress_step.parse_method(spec)
        )
    except ValueError as e:
        return str(e).split(":")[0]
    if is_deferred(cfg):
        return DEFERRED
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


def model_child(specs_: list[str], length: int, args) -> dict:
    """Peak extra memory of every spec's prefill over the full cache's on the model (in this process)."""
    import torch

    torch.set_num_threads(args.threads)
    rows, full = model_prefill.measure(
        specs_,
        length,
        tuple(args.heads),
        args.layers,
        args.budget,
        args.window,
        args.dtype,
        args.device,
        args.tokenizer or default_tokenizer(),
    )
    return {"rows": rows, "full": full}


def default_tokenizer() -> str:
    """The packaged SmolLM2's tokenizer folder (converted on first use)."""
    from restkv.integration.models import resolve

    return resolve("smollm2-135m")


def run_child(specs_: list[str], length: int, args, memory: bool, model: bool = False):
    """``child`` (or, ``model``, ``model_child``) at ``length`` in a fresh process."""
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
        "--layers",
        str(args.layers),
    ]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    if model:
        cmd.append("--model")
    env = dict(os.environ)
    if memory or model:
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


def model_table(names: list[str], lengths: list[int], runs: dict) -> list[dict]:
    """One row per deferred method: its extra peaks over the full cache's prefill, their exponent, the
    multiples of one layer's and of the model's K+V at the largest length, and the prefill times."""
    last = runs[lengths[-1]]["full"]
    rows = []
    for i, name in enumerate(names):
        p = [runs[n]["rows"][i]["peak"] for n in lengths]
        t = [runs[n]["rows"][i]["time"] for n in lengths]
        rows.append(
            {
                "method": name,
                "peak": p,
                "time": t,
                "peak_exp": exponent(lengths, p),
                "layer_multiple": p[-1] / last["layer_kv"],
                "model_multiple": p[-1] / last["model_kv"],
                "time_ratio": t[-1] / last["time"],
            }
        )
    return rows


def print_model_table(rows: list[dict], lengths: list[int], runs: dict, args) -> None:
    n = lengths[-1]
    full = " / ".join(f"{runs[m]['full']['peak'] / 2**20:.1f}" for m in lengths)
    print(
        f"\nselections after every layer's prefill, on a random {args.layers}-layer model of the same heads "
        f"(hidden {args.heads[0] * compress_step.D}, MLP {model_prefill.INTERMEDIATE}, unchunked prefill); "
        f"the full cache's prefill peaks {full} MiB over the weights at L = "
        f"{' / '.join(map(str, lengths))}\n"
    )
    peaks = " | ".join(f"extra L={m} (MiB)" for m in lengths)
    print(
        f"| method | {peaks} | memory exponent | / layer K+V at L={n} | / model K+V at L={n} "
        f"| prefill x full cache's at L={n} |"
    )
    print("|---|" + "---|" * (len(lengths) + 4))
    for r in rows:
        m = " | ".join(f"{x / 2**20:.1f}" for x in r["peak"])
        print(
            f"| {r['method']} | {m} | {fmt(r['peak_exp'])} | {r['layer_multiple']:.2f} | "
            f"{r['model_multiple']:.2f} | {r['time_ratio']:.2f} |"
        )


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
    p.add_argument(
        "--model-lengths",
        type=int,
        nargs="+",
        default=None,
        help="lengths of the model's prefill for the selections after every layer's prefill "
        "(default 8K 16K 32K)",
    )
    p.add_argument("--layers", type=int, default=2, help="layers of that model")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder of the repeat passes' template (default: the packaged SmolLM2's)",
    )
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key in ("lengths", "model_lengths", "heads", "budget", "window"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.heads[0] % args.heads[1]:
        raise ValueError(
            f"--heads: query heads ({args.heads[0]}) must be a multiple of KV heads ({args.heads[1]})"
        )
    if args.child:
        length, *names = args.child
        if args.model:
            print(json.dumps(model_child(names, int(length), args)))
        else:
            print(json.dumps(child(names, int(length), args, args.memory)))
        return None
    names, deferred, skipped = [], [], []
    for spec in specs(args.methods, preset["query_window"]):
        why = one_layer(spec, args.budget, args.window)
        if why is None:
            names.append(spec)
        elif why == DEFERRED:
            deferred.append(spec)
        else:
            skipped.append((spec, why))
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
    rows = one_layer_rows(names, args) if names else []
    for spec, why in skipped:
        print(f"| {spec} | not measured: {why} |")
    model_rows = []
    if deferred:
        runs = {n: run_child(deferred, n, args, memory=True, model=True) for n in args.model_lengths}
        model_rows = model_table(deferred, args.model_lengths, runs)
        print_model_table(model_rows, args.model_lengths, runs, args)
    return rows, model_rows


def one_layer_rows(names: list[str], args) -> list[dict]:
    """Measure and print the one-layer table."""
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
    return rows

if __name__ == "__main__":
    main()
