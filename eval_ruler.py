"""Score RULER predictions (string_match_all / string_match_part x100) and print the table.

Example
-------
python eval_ruler.py --results_dir results/ruler
"""

from restkv.bench.cli import ArgumentParser, results_dir, startup
from restkv.bench.ruler.evaluate import evaluate


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results_dir", default="results/ruler",
                        help="root of <model>/<length>/<task>/<label>.jsonl prediction files")
    parser.add_argument("--csv", default=None, help="table path (default: <results_dir>/ruler_results.csv)")
    args = parser.parse_args(argv)
    startup(parser, lambda a: results_dir(a.results_dir), args)
    # malformed records: one line naming the file and line
    return startup(parser, lambda a: evaluate(a.results_dir, a.csv), args)


if __name__ == "__main__":
    main()
