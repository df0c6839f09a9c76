"""Predict LongBench v2 (503 multiple-choice questions on long contexts) with any methods and budgets.

Example
-------
python run_longbench_v2.py --data_dir data/longbench_v2 --method restkv snapkv fullkv \\
    --max_capacity_prompts 1024 2048 --model_path meta-llama/Llama-3.1-8B-Instruct --save_dir results/longbench_v2
"""

from restkv.bench.cli import Runner, add_common_args, add_dataset_args
from restkv.bench.longbench_v2.run import add_longbench_v2_args, prepare, run

RUNNER = Runner(__doc__.split("\n")[0], (add_common_args, add_dataset_args, add_longbench_v2_args), prepare, run)
build_parser, parse_args, main = RUNNER.build_parser, RUNNER.parse_args, RUNNER.main

if __name__ == "__main__":
    main()
