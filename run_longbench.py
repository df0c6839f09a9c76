"""Predict LongBench (or LongBench-E) with any methods and budgets.

Example
-------
python run_longbench.py --data_dir data/longbench --method restkv snapkv fullkv \\
    --max_capacity_prompts 128 512 --datasets qasper hotpotqa --save_dir results/longbench
"""

from restkv.bench.cli import Runner, add_common_args, add_dataset_args
from restkv.bench.longbench.run import add_longbench_args, prepare, run

RUNNER = Runner(__doc__.split("\n")[0], (add_common_args, add_dataset_args, add_longbench_args), prepare, run)
build_parser, parse_args, main = RUNNER.build_parser, RUNNER.parse_args, RUNNER.main

if __name__ == "__main__":
    main()
