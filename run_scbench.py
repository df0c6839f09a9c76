"""Predict SCBench's shared-context tasks (a context compressed once, several questions) with any methods and budgets.

Example
-------
python run_scbench.py --data_dir data/scbench --tasks scbench_kv scbench_qa_eng --method restkv snapkv fullkv \\
    --max_capacity_prompts 1024 --model_path meta-llama/Llama-3.1-8B-Instruct --save_dir results/scbench
"""

from restkv.bench.cli import Runner, add_common_args, add_dataset_args
from restkv.bench.scbench.run import add_scbench_args, prepare, run

RUNNER = Runner(__doc__.split("\n")[0], (add_common_args, add_dataset_args, add_scbench_args), prepare, run)
build_parser, parse_args, main = RUNNER.build_parser, RUNNER.parse_args, RUNNER.main

if __name__ == "__main__":
    main()
