"""Predict LongBench (or LongBench-E) with any methods and budgets.

Example
-------
python run_longbench.py --data_dir data/longbench --method restkv snapkv fullkv \\
    --max_capacity_prompts 128 512 --datasets qasper hotpotqa --save_dir results/longbench
"""

from restkv.bench.cli import ArgumentParser, add_common_args, add_dataset_args, startup
from restkv.bench.longbench.run import add_longbench_args, datasets_of, prepare, run


def build_parser():
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_dataset_args(parser)
    add_longbench_args(parser)
    return parser


def parse_args(argv=None, parser=None):
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    try:
        args.datasets = datasets_of(args)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv=None):
    parser = build_parser()
    args = parse_args(argv, parser)
    return run(args, startup(parser, prepare, args))


if __name__ == "__main__":
    main()
