"""Score InfiniteBench predictions with the official scorers and print the results table.

Example
-------
python eval_infinite.py --results_dir results/infinite_bench
"""

from restkv.bench.cli import ArgumentParser, results_dir, startup
from restkv.bench.infinitebench.evaluate import evaluate
from restkv.bench.infinitebench.metrics import NEEDS
from restkv.lazy import require


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results_dir", "--output_dir", default="results",
                        help="root of <...>/<task>/<label>.jsonl files (--output_dir: the "
                             "original's name)")
    parser.add_argument("--task", default="all", choices=("all",),
                        help="the original's flag: every task found is scored")
    parser.add_argument("--csv", default=None, help="table path (default: <results_dir>/results_infinite.csv)")
    args = parser.parse_args(argv)
    startup(parser, lambda a: (require(*NEEDS, needed_by="eval_infinite.py"), results_dir(a.results_dir)), args)
    # malformed records: one line naming the file and line
    return startup(parser, lambda a: evaluate(a.results_dir, a.csv), args)


if __name__ == "__main__":
    main()
