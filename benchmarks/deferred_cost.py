"""Cost of the selections finished after the prefill, and the bytes ThinK saves, on the packaged SmolLM2-135M.

Two tables, on one prompt of ``--length`` tokens of Paul Graham essays:

1. Prefill: wall time of ``model(ids)`` (the prefill forward plus every layer's selection, deferred or
   not), the median of ``--reps`` runs taken round robin, its ratio to the full-cache prefill; for
   KVzip, KVCompose and KVgrad (and the configs on KVzip's passes: DMS, ReST-KV over the repeat
   passes) the extra tokens their passes feed the model (relative to the prompt) and the time of the
   passes alone (relative to the full-cache prefill). ``--json`` also writes, per config, the
   medians of both the wall and the process CPU time (with ``--threads 1`` the compute time,
   robust to other processes).
2. Memory: ``restkv.memory_report`` after the prefill, summed over the layers: the bytes a full cache
   would hold and the bytes held, with and without ThinK's ``pruning_ratio``.

Usage::

    PYTHONPATH=. python benchmarks/deferred_cost.py --length 2048 --budget 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import restkv
from restkv.eviction import deferred
from restkv.bench.models import essays_dir, load_model
from restkv.methods import kvcompose, kvgrad, kvzip, restkv_repeat

REPLAYED = (kvzip, kvcompose, kvgrad, restkv_repeat)  # methods scored from passes after the prefill

CONFIGS = {
    "fullkv": dict(method="fullkv"),
    "snapkv": dict(method="snapkv"),
    "snapkv global": dict(method="snapkv", layer_budget="global"),
    "layer_defensivekv": dict(method="layer_defensivekv"),
    "kvzip": dict(method="kvzip"),
    "kvcompose": dict(method="kvcompose"),
    "kvgrad": dict(method="kvgrad"),
    "restkv_repeat": dict(method="restkv_repeat"),
    "dms_w64": dict(method="dms", window_size=64),
}


def essay_prompt(tokenizer, length: int) -> torch.Tensor:
    text = "\n\n".join(p.read_text() for p in sorted(essays_dir().glob("*.txt"))[:20])
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)[:length]])


class PassClock:
    """Tokens fed to the model by the passes (KVzip's, KVCompose's, KVgrad's with its backward), their wall time (``deferred.replay_scores``)
    and the part of it spent scoring (the methods' ``score``: the passes' attention at every layer);
    the same two in process CPU time (``cpu_seconds``, ``cpu_scoring``)."""

    def __init__(self, decoder):
        self.tokens, self.seconds, self.scoring, self.first = 0, 0.0, 0.0, True
        self.cpu_seconds, self.cpu_scoring = 0.0, 0.0
        self._replay, self._scores = deferred.replay_scores, [m.score for m in REPLAYED]
        deferred.replay_scores = self._timed(self._replay, "seconds")
        for m in REPLAYED:
            m.score = self._timed(m.score, "scoring")
        self._hook = decoder.register_forward_pre_hook(self._count, with_kwargs=True)

    def _timed(self, fn, field):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
                cpu_field = "cpu_" + field
                setattr(self, cpu_field, getattr(self, cpu_field) + time.process_time() - c0)
        return timed

    def _count(self, module, args, kwargs):
        if self.first:  # the prefill itself
            self.first = False
        else:
            fed = kwargs.get("input_ids")  # KVgrad's passes feed embeddings
            self.tokens += (kwargs["inputs_embeds"] if fed is None else fed).shape[1]

    def close(self):
        deferred.replay_scores = self._replay
        for m, score in zip(REPLAYED, self._scores):
            m.score = score
        self._hook.remove()


@torch.no_grad()
def prefill(model, ids, knobs):
    """One prefill -> (wall s, pass tokens, pass s, scoring s, memory report,
    CPU s: (prefill, passes, scoring))."""
    restkv.configure(model, **knobs)
    clock = PassClock(deferred.decoder_of(model))
    try:
        t0 = time.perf_counter()
        c0 = time.process_time()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
    finally:
        clock.close()
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    cpus = (cpu, clock.cpu_seconds, clock.cpu_scoring)
    return seconds, clock.tokens, clock.seconds, clock.scoring, restkv.memory_report(cache), cpus


def write_json(args, runs: dict, length: int) -> None:
    """The prefill table's medians per config: wall and CPU seconds of the prefill, the passes and
    their scoring, the passes' tokens, and the ratios to the full-cache prefill and to the prompt."""
    full_cpu = statistics.median(r[5][0] for r in runs["fullkv"])
    full_wall = statistics.median(r[0] for r in runs["fullkv"])
    rows = {}
    for name, rs in runs.items():
        cpu, pass_cpu, scoring_cpu = (statistics.median(r[5][i] for r in rs) for i in range(3))
        wall, tokens, passes, scoring = (statistics.median(r[i] for r in rs) for i in range(4))
        rows[name] = {
            "knobs": CONFIGS[name],
            "prefill_cpu": cpu,
            "prefill_wall": wall,
            "pass_cpu": pass_cpu,
            "pass_scoring_cpu": scoring_cpu,
            "pass_wall": passes,
            "pass_scoring_wall": scoring,
            "pass_tokens": tokens,
            "pass_tokens_x_prompt": tokens / length,
            "pass_cpu_x_full": pass_cpu / full_cpu,
            "pass_wall_x_full": passes / full_wall,
        }
    settings = {"model": "smollm2-135m", "length": length, "budget": args.budget,
                "window": args.window, "reps": args.reps, "threads": args.threads}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--pruning-ratio", type=float, default=0.4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="methods of the prefill table (fullkv, the reference, always runs)")
    p.add_argument("--memory", nargs="+", default=["fullkv", "snapkv", "snapkv global", "kvzip"], choices=list(CONFIGS),
                   help="methods of the memory table (each one more prefill with ThinK)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="the printed table's seconds: wall (elapsed) or cpu (the process's CPU time: a "
                        "shared machine, with --threads 1); --json writes both")
    p.add_argument("--json", type=Path,
                   help="also write the prefill table's medians (wall and CPU) to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m")
    ids = essay_prompt(tokenizer, args.length)
    L = ids.shape[1]
    base = dict(max_capacity_prompt=args.budget, window_size=args.window)

    def knobs(name, ratio=None):
        # a config's own window wins
        cfg = {"window_size": args.window, **CONFIGS[name], "pruning_ratio": ratio}
        return cfg if name == "fullkv" else {**base, **cfg}

    print(f"SmolLM2-135M float32 sdpa, CPU {args.threads} threads, {args.clock} clock; prompt {L} tokens, "
          f"budget {args.budget}, window {args.window}\n")
    runs = {name: [] for name in dict.fromkeys(["fullkv", *args.methods])}
    prefill(model, ids[:, :64], knobs("fullkv"))  # warm-up
    for _ in range(args.reps):
        for name in runs:
            runs[name].append(prefill(model, ids, knobs(name)))
    shown = runs
    if args.clock == "cpu":  # the CPU seconds in the wall ones' places
        shown = {n: [(r[5][0], r[1], r[5][1], r[5][2]) for r in rs] for n, rs in runs.items()}
    full = statistics.median(r[0] for r in shown["fullkv"])
    print(f"| method | prefill {args.clock} (s) | x full | pass tokens | x prompt | passes (s) | x full "
          f"| of which scoring (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in shown.items():
        wall, tokens, passes, scoring = (statistics.median(r[i] for r in rs) for i in range(4))
        print(f"| {name} | {wall:.2f} | {wall / full:.2f} | {tokens} | {tokens / L:.3f} | {passes:.2f} | "
              f"{passes / full:.2f} | {scoring:.2f} |")
    if args.json:
        write_json(args, runs, L)
    print(f"\nKV cache after the prefill (MiB), pruning_ratio {args.pruning_ratio} (head_dim "
          f"{model.config.head_dim}: {int(model.config.head_dim * args.pruning_ratio)} key channels dropped)\n")
    print("| method | full cache | held | held with ThinK | ThinK / without |")
    print("|---|---|---|---|---|")
    for name in args.memory:
        plain = (runs[name][0] if name in runs else prefill(model, ids, knobs(name)))[4]
        pruned = prefill(model, ids, knobs(name, args.pruning_ratio))[4]
        full_b, held, thin = (sum(r[k] for r in rows) for rows, k in ((plain, "full_bytes"), (plain, "held_bytes"),
                                                                         (pruned, "held_bytes")))
        print(f"| {name} | {full_b / 2**20:.2f} | {held / 2**20:.2f} | {thin / 2**20:.2f} | {thin / held:.3f} |")


if __name__ == "__main__":
    main()
