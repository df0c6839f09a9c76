"""Predict LongBench (or LongBench-E) with any methods and budgets.

Example
-------
python run_longbench.py --data_dir data/longbench --method restkv snapkv fullkv \\
    --max_capacity_prompts 128 512 --datasets qasper hotpotqa --save_dir results/longbench
"""

import argparse

from restkv.bench.cli import add_common_args
from restkv.bench.longbench.data import load_records
from restkv.bench.longbench.runner import Task, add_loop_args, run_tasks
from restkv.bench.longbench.tasks import DATASETS, LONGBENCH_E, MAX_NEW_TOKENS, NO_CHAT, PROMPTS

KEPT = ("_id", "dataset", "language", "length", "answers", "all_classes")


def make_task(dataset, records, longbench_e=False):
    """The shared loop's :class:`Task` for one LongBench dataset."""
    return Task(
        name=f"{dataset}_e" if longbench_e else dataset,
        records=records,
        text=lambda r, chat: PROMPTS[dataset].format(**r),
        output=lambda r: {k: r[k] for k in KEPT},
        max_new_tokens=MAX_NEW_TOKENS[dataset],
        chat=dataset not in NO_CHAT,
        key="_id",
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_loop_args(parser)
    parser.add_argument("--data_dir", default="data/longbench", help="folder of the official <dataset>.jsonl files")
    parser.add_argument("--datasets", nargs="+", default=None,
                        help="datasets to run (default: all 21, or the 13 of LongBench-E with --e)")
    parser.add_argument("--e", action="store_true", help="LongBench-E (<dataset>_e.jsonl)")
    parser.add_argument("--hub", action="store_true",
                        help="load missing files from the hub through `datasets` (needs network)")
    args = parser.parse_args(argv)
    names = args.datasets or (LONGBENCH_E if args.e else DATASETS)
    allowed = LONGBENCH_E if args.e else DATASETS
    unknown = [d for d in names if d not in allowed]
    if unknown:
        parser.error(f"unknown datasets {unknown}; choose from {allowed}")
    args.datasets = names
    return args


def main(argv=None):
    args = parse_args(argv)
    tasks = [make_task(d, load_records(args.data_dir, d, args.e, args.max_num_examples, args.hub), args.e)
             for d in args.datasets]
    return run_tasks(args, tasks, {"benchmark": "longbench_e" if args.e else "longbench"})


if __name__ == "__main__":
    main()
