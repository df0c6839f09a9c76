"""Score SCBench predictions (shared context, several questions) and print the results table.

Example
-------
python eval_scbench.py --results_dir results/scbench
"""

from restkv.bench.evaluation import evaluator_main
from restkv.bench.scbench.evaluate import evaluate
from restkv.bench.scbench.metrics import NEEDS


def main(argv=None):
    return evaluator_main(
        __doc__.split("\n")[0], evaluate, "results_scbench.csv", "<...>/<task>/<label>.jsonl", argv, NEEDS
    )


if __name__ == "__main__":
    main()
