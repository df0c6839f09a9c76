"""Predict InfiniteBench tasks with any methods and budgets.

Example
-------
python run_infinite_bench.py --data_dir data/infinite_bench --tasks passkey kv_retrieval \\
    --method restkv snapkv fullkv --max_capacity_prompts 1024 --save_dir results/infinite_bench
"""

import argparse

from restkv.bench.cli import add_common_args, add_dataset_args
from restkv.bench.infinitebench.run import add_infinitebench_args, run


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_dataset_args(parser)
    add_infinitebench_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
