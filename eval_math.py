"""Score math predictions (MATH500, AIME 2024/2025, GSM8K) and print the results table.

Example
-------
python eval_math.py --results_dir results/math
"""

from restkv.bench.evaluation import evaluator_main
from restkv.bench.reasoning.evaluate import evaluate


def main(argv=None):
    return evaluator_main(__doc__.split("\n")[0], evaluate, "results_math.csv", "<...>/<dataset>/<label>.jsonl", argv)


if __name__ == "__main__":
    main()
