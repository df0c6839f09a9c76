"""Predict InfiniteBench tasks with any methods and budgets.

Example
-------
python run_infinite_bench.py --data_dir data/infinite_bench --tasks passkey kv_retrieval \\
    --method restkv snapkv fullkv --max_capacity_prompts 1024 --save_dir results/infinite_bench
"""

from restkv.bench.cli import ArgumentParser, add_common_args, add_dataset_args, startup
from restkv.bench.infinitebench.run import add_infinitebench_args, prepare, run


def build_parser():
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_dataset_args(parser)
    add_infinitebench_args(parser)
    return parser


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    return run(args, startup(parser, prepare, args))


if __name__ == "__main__":
    main()
