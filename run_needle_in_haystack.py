"""Needle-in-a-Haystack sweep over methods, budgets, context lengths and depths.

With no arguments: restkv vs snapkv vs fullkv at budget 128 on the packaged
SmolLM2, 1K and 2K tokens, depths 0/50/100 %, pass-key and San Francisco needles.

Example
-------
python run_needle_in_haystack.py --method restkv snapkv pyramidkv h2o streamingllm fullkv \\
    --max_capacity_prompts 128 256 512 1024 --context_lengths 2048 4096 --depth_percents 0:100:10
"""

from restkv.bench.cli import Runner, add_common_args
from restkv.bench.needle.report import show
from restkv.bench.needle.run import add_needle_args, prepare, run


def run_and_show(args, plan):
    path, records = run(args, plan)
    return path, records, show(path, records, plots=not args.no_plots)


RUNNER = Runner(__doc__.split("\n")[0], (add_common_args, add_needle_args), prepare, run_and_show)
build_parser, parse_args, main = RUNNER.build_parser, RUNNER.parse_args, RUNNER.main

if __name__ == "__main__":
    main()
