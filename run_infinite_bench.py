"""Predict InfiniteBench tasks with any methods and budgets.

Example
-------
python run_infinite_bench.py --data_dir data/infinite_bench --tasks passkey kv_retrieval \\
    --method restkv snapkv fullkv --max_capacity_prompts 1024 --save_dir results/infinite_bench
"""

from restkv.bench.cli import Runner, add_common_args, add_dataset_args
from restkv.bench.infinitebench.run import add_infinitebench_args, prepare, run

RUNNER = Runner(__doc__.split("\n")[0], (add_common_args, add_dataset_args, add_infinitebench_args), prepare, run)
build_parser, parse_args, main = RUNNER.build_parser, RUNNER.parse_args, RUNNER.main

if __name__ == "__main__":
    main()
