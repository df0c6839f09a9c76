"""Cost of the eviction step, per method, on one Llama-3-8B-shaped attention layer.

The step is ``restkv.eviction.select.select``: scoring, GQA reduction, top-B and the gather of the kept
entries, from the prefill's queries, keys and values (random, no download). The W_O factor of
ReST-KV is computed once per model and cached, so it is built before the clock starts (as are the
prompt's RoPE cos/sin, which the model computes anyway; Expected Attention's future RoPE is timed).

Each length runs in two subprocesses, one for time and one for memory; every method gets one
warm-up call. Time: median of ``--reps`` calls, each on a fresh ``Observation`` (nothing cached
between calls), taken round robin over the methods; both wall time and process CPU time are shown
(CPU time counts all threads; with one thread it is the compute time, robust to other processes
sharing the cores); on CUDA (``--device cuda``) clocks are read after ``torch.cuda.synchronize(device)``.
A method may be named (``restkv_boundary1=restkv:refine_rounds=1,refine_candidates=boundary``: the
name goes into the table and the ``--json`` file). ``layer_forward`` is a reference row: the forward
of one Llama-3-8B-shaped decoder layer (random weights, sdpa, causal) over the ``L`` prompt tokens,
the share of one layer in a prefill or in a method's own passes after it (KVzip's).
Peak extra memory: on CUDA ``torch.cuda.max_memory_allocated(device)`` during one call minus the memory
allocated before it; on CPU the process's peak resident set during one call (VmHWM,
reset through ``/proc/self/clear_refs`` just before) minus its resident set before it; inputs are
allocated beforehand and not counted. The memory child runs with a fixed glibc mmap threshold
(128 KiB), so every large buffer goes back to the system when torch frees it and earlier calls leave
no reusable heap behind; the timing child keeps glibc's defaults, as a real run does.

Usage::

    python benchmarks/compress_step.py --lengths 4096 16384 32768
    python benchmarks/compress_step.py --device cuda --lengths 32768 131072
    python benchmarks/compress_step.py --lengths 4096 --budget 512 --threads 1 --json step.json \\
        --methods restkv restkv_boundary1=restkv:refine_rounds=1,refine_candidates=boundary \\
        layer_forward
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from devices import PeakMemory, process_status, sync  # noqa: F401  (process_status: re-exported)

HQ, HKV, D, HIDDEN = 32, 8, 128, 4096
INTERMEDIATE = 14336  # Llama-3-8B's MLP width (the ``layer_forward`` row)
LAYER_FORWARD = "layer_forward"
LAYER, LAYERS = 15, 32  # a middle layer of Llama-3-8B's 32 (LaCache's ladder depends on the depth)
DEFAULT_METHODS = ["snapkv", "restkv", "restkv:use_wo=False", "restkv:metric_mode=before", "restkv:query_window=256",
                   "restkv:query_proxy=expected", "restkv:query_proxy=both", "cam", "streamingllm",
                   "l2norm", "expected_attention", "keydiff", "criticalkv", "criticalkv:value_norm=l2", "critical_adakv",
                   "chunkkv", "defensivekv", "tova", "lacache", "random", "snapkv:refine_rounds=2", "snapkv:refine_rounds=8",
                   "restkv:refine_rounds=8", "restkv:refine_rounds=2,refine_pool=16", "adakv:refine_rounds=8",
                   "cur", "leverage", "lagkv", "noncausal", "compactor", "simlayerkv",
                   "noncausal:head_budget=threshold,threshold=0.0", "qfilter",
                   "finch", "entropy_gated_chunkkv", "cap", "snapkv:merge=value",
                   "expected_attention_stats", "duo_attention",
                   "kvzap", "kvzap:kvzap_type=linear", "fastkvzip", "rkv", "triattention"]


def _value(text: str):
    """A knob value written in a spec: bool, int, float, else the string."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_method(spec: str) -> dict:
    """``"restkv:metric_mode=before,use_wo=False"`` -> knobs dict (a ``window_size`` there overrides ``--window``)."""
    name, _, rest = spec.partition(":")
    knobs = {"method": name}
    for item in filter(None, rest.split(",")):
        key, value = item.split("=")
        knobs[key] = _value(value)
    return knobs


def named(spec: str) -> tuple[str, str]:
    """``"restkv_boundary1=restkv:refine_rounds=1"`` -> ("restkv_boundary1",
    "restkv:refine_rounds=1"); an unnamed spec is its own name."""
    head, sep, rest = spec.partition(":")
    if "=" not in head:
        return spec, spec
    name, _, method = head.partition("=")
    if not name or not method:
        raise ValueError(f"--methods: {spec!r} is not NAME=METHOD[:knob=value,...]")
    return name, method + sep + rest


def method_spec(knobs: dict) -> str:
    """The inverse of ``parse_method``: ``{"method": "snapkv", "window_size": 64}`` -> ``"snapkv:window_size=64"``."""
    rest = ",".join(f"{k}={v}" for k, v in knobs.items() if k != "method")
    return knobs["method"] + (":" + rest if rest else "")


def time_and_peak(calls: list, reps: int, memory: bool, slow: float | None = None, device="cpu") -> list[dict]:
    """Per call (a function of no arguments): ``{"time", "cpu", "reps"}``, medians over ``reps`` calls, or
    (``memory``) ``{"peak"}``, the peak extra memory of one call on ``device`` (``devices.PeakMemory``: the
    CUDA allocator's peak on a CUDA device, the resident set on CPU).

    Every call is warmed up first (one-time initialisation and code pages are not counted). Timed calls go
    round robin, so that load from other processes affects all of them alike; on CUDA the clock is read after
    ``torch.cuda.synchronize(device)``. A call whose warm-up took more than ``slow`` CPU seconds is timed once.
    """
    peaks, warm = [], []
    for call in calls:
        c0 = time.process_time()
        call()
        sync(device)
        warm.append(time.process_time() - c0)
        if memory:
            with PeakMemory(device) as mem:
                out = call()
            peaks.append(mem.extra)
            del out
    if memory:
        return [{"peak": p} for p in peaks]
    times, cpu = [[] for _ in calls], [[] for _ in calls]
    for i in range(reps):
        for call, t, c, w in zip(calls, times, cpu, warm):
            if i and slow is not None and w > slow:
                continue
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            call()
            sync(device)
            t.append(time.perf_counter() - t0)
            c.append(time.process_time() - c0)
    return [{"time": statistics.median(t), "cpu": statistics.median(c), "reps": len(t)} for t, c in zip(times, cpu)]


def layer_forward_call(length: int, dtype: str, device: str = "cpu",
                       heads: tuple[int, int] = (HQ, HKV)):
    """The forward of one random Llama-3-8B-shaped decoder layer (sdpa, causal) over ``length``
    tokens [1, length, HIDDEN], a function of no arguments; the layer, its input and RoPE are built
    here."""
    import torch

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hq, hkv = heads
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=hq,
                         num_key_value_heads=hkv, head_dim=D,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    config._attn_implementation = "sdpa"
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, LAYER).to(device=device, dtype=dt).eval()
    x = torch.randn(1, length, HIDDEN, dtype=dt, device=device)
    positions = torch.arange(length, device=device)[None]
    cos_sin = LlamaRotaryEmbedding(config).to(device)(x, positions)

    def call():
        with torch.no_grad():
            return layer(x, attention_mask=None, position_embeddings=cos_sin,
                         position_ids=positions)

    return call


def step_calls(specs: list[str], length: int, budget: int, window: int, dtype: str, device: str = "cpu",
               heads: tuple[int, int] = (HQ, HKV)) -> tuple[list, int]:
    """One call of the eviction step (``select``) per spec on a random layer of ``heads`` (query, KV) heads
    and ``length`` entries -> (calls, bytes of the layer's K+V). The inputs and W_O factor are built
    here. The spec ``layer_forward`` is the layer's forward instead (``layer_forward_call``)."""
    import torch

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from restkv.config import CompressionConfig
    from restkv.scoring.observe import Observation, wo_factor
    from restkv.scoring.rope import Rope, rotary_function
    from restkv.eviction.plans import on_device
    from restkv.eviction.select import select
    from restkv.strategies.budgets import headkv_budgets

    hq, hkv = heads
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    q = torch.randn(1, hq, length, D, dtype=dt, device=device)
    k = torch.randn(1, hkv, length, D, dtype=dt, device=device)
    v = torch.randn(1, hkv, length, D, dtype=dt, device=device)
    valid = torch.ones(1, length, dtype=torch.bool, device=device)
    o_proj = torch.randn(HIDDEN, hq * D, dtype=dt, device=device) / HIDDEN**0.5
    wo = wo_factor(o_proj, hq)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=HIDDEN, num_attention_heads=hq, head_dim=D,
                                              rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    rope = Rope.of(rotary_function(rotary.to(device)), torch.arange(length, device=device)[None])
    base = {"max_capacity_prompt": budget, "window_size": window}
    cfgs = [None if s == LAYER_FORWARD else
            CompressionConfig.from_kwargs(**{**base, **parse_method(s)}) for s in specs]

    hidden = torch.randn(1, length, HIDDEN, dtype=dt, device=device)  # the layer's attention input

    def constants(cfg):
        """A method's per-layer constants, computed once per model (random here): Q-Filters' filters,
        the query statistics (Expected Attention's, TriAttention's), DuoAttention's streaming heads, a trained
        method's weights."""
        from restkv.integration import trained

        name = cfg.scorer.name
        g = torch.Generator().manual_seed(0)
        if name == "fastkvzip":
            return on_device(trained.new_gate(HIDDEN, hkv, hq // hkv, g), torch.device(device))
        if name == "kvzap":
            new = trained.new_mlp if cfg.kvzap_type == "mlp" else trained.new_linear
            return on_device(new(HIDDEN, hkv, g), torch.device(device))
        if name == "qfilter":
            return torch.randn(hkv, D, device=device)
        if name == "expected_attention_stats":
            return torch.randn(hq, D, device=device), torch.eye(D, device=device).expand(hq, D, D)
        if name == "duo_attention":
            return torch.arange(hkv, device=device) < hkv // 2
        if name == "triattention":
            return torch.randn(hq, D, device=device), torch.rand(hq, D // 2, device=device)
        return None

    def curve(cfg):
        """The layer's row of a budget table (random: the step's cost does not depend on its values): LU-KV's
        curve [99, Hkv], or HeadKV's per-head budgets [Hkv] from a random head-importance table."""
        g = torch.Generator().manual_seed(0)
        if cfg.get("head_budget") == "headkv":
            importance = torch.rand(LAYERS, hkv, dtype=torch.float64, generator=g)
            return headkv_budgets(importance, budget - window, cfg.headkv_beta)[LAYER].to(device)
        if cfg.get("head_budget") != "lukv":
            return None
        return torch.rand(99, hkv, dtype=torch.float64, generator=g).to(device)

    def run(cfg, data, table):
        obs = Observation(q, k, v, valid, window=cfg.window_size, budget=budget, scaling=D**-0.5, wo_factor=wo,
                          wo_weight=o_proj, rope=rope, layer=LAYER, num_layers=LAYERS, data=data,
                          hidden=hidden if cfg.scorer.reads_hidden else None)
        with torch.no_grad():
            return select(obs, cfg, table)

    calls = []
    for cfg in cfgs:
        if cfg is None:
            calls.append(layer_forward_call(length, dtype, device, heads))
        else:
            data, table = constants(cfg), curve(cfg)
            calls.append(lambda cfg=cfg, data=data, table=table: run(cfg, data, table))
    return calls, 2 * k.numel() * k.element_size()


def measure(specs: list[str], length: int, budget: int, window: int, dtype: str, reps: int, threads: int,
            memory: bool, device: str = "cpu") -> list:
    """Time (``memory=False``) or peak extra memory of ``select`` per method at one length (in a child)."""
    import torch

    torch.set_num_threads(threads)
    calls, kv_bytes = step_calls(specs, length, budget, window, dtype, device)
    results = time_and_peak(calls, reps, memory, device=device)
    return [{**r, "kv_bytes": kv_bytes} for r in results]


def measure_in_child(args, specs, length, memory):
    """``measure`` in a fresh process (``args``: budget, window, dtype, reps, threads)."""
    cmd = [sys.executable, __file__, "--child", str(length), *specs, "--budget", str(args.budget), "--window",
           str(args.window), "--dtype", args.dtype, "--reps", str(args.reps), "--threads", str(args.threads),
           "--device", args.device]
    env = dict(os.environ)
    if memory:
        cmd.append("--memory")
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help="method[:knob=value,...] (window_size there overrides --window); snapkv is always "
                   "measured as the reference")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:n]: where the layer's tensors and the step run")
    p.add_argument("--h2o-max-length", type=int, default=4096, help="skip h2o (if listed) above this length: it scores every query, O(L^2)")
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    p.add_argument("--child", nargs="+", metavar="LENGTH METHOD", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        length, *specs = args.child
        print(json.dumps(measure(specs, int(length), args.budget, args.window, args.dtype, args.reps, args.threads,
                                 args.memory, args.device)))
        return
    entries = [named(m) for m in args.methods]
    methods = [("snapkv", "snapkv")] + [e for e in entries if e != ("snapkv", "snapkv")]
    where = f"{args.threads} CPU threads" if args.device == "cpu" else args.device
    print(f"compress step, one layer: {HQ} q heads, {HKV} KV heads, head_dim {D}, {args.dtype}, "
          f"budget {args.budget}, window {args.window}, {where}, median of {args.reps}\n")
    print("| L | method | CPU time (ms) | x SnapKV | wall (ms) | x SnapKV | peak extra (MiB) | x SnapKV | x layer K+V |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for length in args.lengths:
        too_long = length > args.h2o_max_length
        kept = [(n, s) for n, s in methods if not (s.startswith("h2o") and too_long)]
        specs = [s for _, s in kept]
        times, peaks = measure_in_child(args, specs, length, False), measure_in_child(args, specs, length, True)
        results = [{**t, **m} for t, m in zip(times, peaks)]
        ref = results[0]
        for (name, spec), r in zip(kept, results):
            row = {
                "name": name,
                "spec": spec,
                "length": length,
                **r,
                "cpu_x_snapkv": r["cpu"] / ref["cpu"],
                "time_x_snapkv": r["time"] / ref["time"],
                "peak_x_snapkv": r["peak"] / max(ref["peak"], 1),
                "peak_x_kv": r["peak"] / r["kv_bytes"],
            }
            rows.append(row)
            label = spec if name == spec else f"{name} ({spec})"
            print(f"| {length} | {label} | {r['cpu'] * 1e3:.0f} | {row['cpu_x_snapkv']:.2f} | "
                  f"{r['time'] * 1e3:.0f} | {row['time_x_snapkv']:.2f} | "
                  f"{r['peak'] / 2**20:.0f} | {row['peak_x_snapkv']:.2f} | "
                  f"{row['peak_x_kv']:.2f} |",
                  flush=True)
    if args.json:
        keys = ("budget", "window", "dtype", "reps", "threads", "device")
        settings = {k: getattr(args, k) for k in keys}
        shape = {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "hidden": HIDDEN,
                 "intermediate": INTERMEDIATE, "layer": LAYER, "layers": LAYERS}
        out = {"settings": settings, "shape": shape, "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")

if __name__ == "__main__":
    main()
