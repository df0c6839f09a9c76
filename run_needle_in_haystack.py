"""Needle-in-a-Haystack sweep over methods, budgets, context lengths and depths.

With no arguments: restkv vs snapkv vs fullkv at budget 128 on the packaged
SmolLM2, 1K and 2K tokens, depths 0/50/100 %, pass-key and San Francisco needles.

Example
-------
python run_needle_in_haystack.py --method restkv snapkv pyramidkv h2o streamingllm fullkv \\
    --max_capacity_prompts 128 256 512 1024 --context_lengths 2048 4096 --depth_percents 0:100:10
"""

import argparse
import os

from restkv.bench.cli import add_common_args
from restkv.bench.needle import add_needle_args, run, summary_table


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_needle_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    path, records = run(args)
    print(f"\nresults: {path}")
    if not records:
        return path, records, []
    for metric in ("score", "rouge1_f"):
        print(f"\n{metric} (mean over depths and needles)\n{summary_table(records, metric)}")
    pngs = []
    if not args.no_plots:
        from visualization.plots import budget_curve, needle_heatmaps

        out_dir = os.path.dirname(path)
        pngs = needle_heatmaps(records, out_dir) + [budget_curve(records, os.path.join(out_dir, "budget_curve.png"))]
        print("\nplots:\n" + "\n".join(pngs))
    return path, records, pngs


if __name__ == "__main__":
    main()
