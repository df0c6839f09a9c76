"""Predict the math reasoning sets (MATH500, AIME 2024/2025, GSM8K) with any methods and budgets.

Example
-------
python run_math.py --datasets math500 aime25 --method restkv snapkv fullkv --max_capacity_prompts 128 \\
    --decode_interval 128 --model_path deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --save_dir results/math
"""

from restkv.bench.cli import Runner, add_common_args, add_dataset_args
from restkv.bench.reasoning.run import add_math_args, prepare, run

RUNNER = Runner(__doc__.split("\n")[0], (add_common_args, add_dataset_args, add_math_args), prepare, run)
build_parser, parse_args, main = RUNNER.build_parser, RUNNER.parse_args, RUNNER.main

if __name__ == "__main__":
    main()
