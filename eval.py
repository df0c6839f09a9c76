"""Score LongBench predictions with the official metrics and print the results table.

Example
-------
python eval.py --results_dir results/longbench          # LongBench
python eval.py --results_dir results/longbench --e      # LongBench-E, with length buckets
"""

import argparse

from restkv.bench.longbench.evaluate import evaluate


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results_dir", default="results", help="root of <...>/<dataset>/<label>.jsonl files")
    parser.add_argument("--e", "--longbench_e", dest="e", action="store_true", help="score LongBench-E predictions")
    parser.add_argument("--csv", default=None, help="table path (default: <results_dir>/results[_e].csv)")
    args = parser.parse_args(argv)
    return evaluate(args.results_dir, args.e, args.csv)


if __name__ == "__main__":
    main()
