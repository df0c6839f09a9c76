"""Predict LongBench (or LongBench-E) with any methods and budgets.

Example
-------
python run_longbench.py --data_dir data/longbench --method restkv snapkv fullkv \\
    --max_capacity_prompts 128 512 --datasets qasper hotpotqa --save_dir results/longbench
"""

import argparse

from restkv.bench.cli import add_common_args, add_dataset_args
from restkv.bench.longbench.run import add_longbench_args, datasets_of, run


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_dataset_args(parser)
    add_longbench_args(parser)
    args = parser.parse_args(argv)
    try:
        args.datasets = datasets_of(args)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
