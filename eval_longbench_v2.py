"""Score LongBench v2 predictions: accuracy overall, by difficulty (easy/hard) and by length (short/medium/long).

Example
-------
python eval_longbench_v2.py --results_dir results/longbench_v2
"""

from restkv.bench.evaluation import evaluator_main
from restkv.bench.longbench_v2.evaluate import evaluate


def main(argv=None):
    return evaluator_main(
        __doc__.split("\n")[0], evaluate, "results_longbench_v2.csv", "<...>/longbench_v2/<label>.jsonl", argv
    )


if __name__ == "__main__":
    main()
