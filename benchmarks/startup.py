"""Startup time of every runner's ``--help``, a mistyped flag and a bad budget, beside ``import torch``.

Each command runs in a fresh interpreter (the median of ``--repeats`` runs, wall clock); the last
column is the time over that of ``python -c "import torch, transformers"`` measured in the same run,
what every such answer cost while the runners imported them first.

    python benchmarks/startup.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = ("run_needle_in_haystack.py", "run_ruler.py", "run_longbench.py", "run_infinite_bench.py",
           "eval.py", "eval_infinite.py", "eval_ruler.py", "-m restkv.bench.ruler.generate")
CASES = {"--help": ["--help"], "mistyped flag": ["--no_such_flag"], "budget 0": ["--max_capacity_prompts", "0"]}


def seconds(argv, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    heavy = seconds(["-c", "import torch, transformers"], args.repeats)
    print(f"`import torch, transformers`: {heavy:.2f} s (median of {args.repeats})\n")
    print("| runner | " + " | ".join(f"{case} (s)" for case in CASES) + " | --help / import torch |")
    print("|---|" + "---|" * (len(CASES) + 1))
    for runner in RUNNERS:
        command = runner.split()
        times = {case: seconds(command + extra, args.repeats) for case, extra in CASES.items()
                 if case != "budget 0" or runner.startswith("run_")}
        cells = [f"{times[c]:.2f}" if c in times else "-" for c in CASES]
        print(f"| {runner} | " + " | ".join(cells) + f" | {times['--help'] / heavy:.2f} |")


if __name__ == "__main__":
    main()
