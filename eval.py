"""Score LongBench predictions with the official metrics and print the results table.

Example
-------
python eval.py --results_dir results/longbench          # LongBench
python eval.py --results_dir results/longbench --e      # LongBench-E, with length buckets
"""

from restkv.bench.cli import ArgumentParser, results_dir, startup
from restkv.bench.longbench.evaluate import evaluate
from restkv.bench.longbench.metrics import NEEDS
from restkv.lazy import require


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results_dir", default="results", help="root of <...>/<dataset>/<label>.jsonl files")
    parser.add_argument("--e", "--longbench_e", dest="e", action="store_true", help="score LongBench-E predictions")
    parser.add_argument("--csv", default=None, help="table path (default: <results_dir>/results[_e].csv)")
    args = parser.parse_args(argv)
    startup(parser, lambda a: (require(*NEEDS, needed_by="eval.py"), results_dir(a.results_dir)), args)
    # malformed records: one line naming the file and line
    return startup(parser, lambda a: evaluate(a.results_dir, a.e, a.csv), args)


if __name__ == "__main__":
    main()
