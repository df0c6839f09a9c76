"""Needle-in-a-Haystack sweep over methods, budgets, context lengths and depths.

With no arguments: restkv vs snapkv vs fullkv at budget 128 on the packaged
SmolLM2, 1K and 2K tokens, depths 0/50/100 %, pass-key and San Francisco needles.

Example
-------
python run_needle_in_haystack.py --method restkv snapkv pyramidkv h2o streamingllm fullkv \\
    --max_capacity_prompts 128 256 512 1024 --context_lengths 2048 4096 --depth_percents 0:100:10
"""

from restkv.bench.cli import ArgumentParser, add_common_args, startup
from restkv.bench.needle.report import show
from restkv.bench.needle.run import add_needle_args, prepare, run


def build_parser():
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_needle_args(parser)
    return parser


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = startup(parser, prepare, args)
    path, records = run(args, plan)
    return path, records, show(path, records, plots=not args.no_plots)


if __name__ == "__main__":
    main()
