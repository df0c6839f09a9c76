"""Predicting LongBench (or LongBench-E): the flags and the run of ``run_longbench.py``."""

from ..datasets import Dataset, default_data_dir, prepare_datasets, run_datasets
from .data import load_records
from .tasks import DATASETS, LONGBENCH_E, MAX_NEW_TOKENS, NO_CHAT, PROMPTS

KEPT = ("_id", "dataset", "language", "length", "answers", "all_classes")


def make_task(dataset, records, longbench_e=False):
    """The :class:`restkv.bench.datasets.Dataset` of one LongBench dataset."""
    return Dataset(
        name=f"{dataset}_e" if longbench_e else dataset,
        records=records,
        text=lambda r, chat: PROMPTS[dataset].format(**r),
        output=lambda r: {k: r[k] for k in KEPT},
        max_new_tokens=MAX_NEW_TOKENS[dataset],
        chat=dataset not in NO_CHAT,
        key="_id",
        question=lambda r, chat: PROMPTS[dataset].split("{context}", 1)[1].format(**r),
    )


def add_longbench_args(parser):
    """Flags of the LongBench data (besides :func:`restkv.bench.cli.add_dataset_args`)."""
    data = parser.add_argument(
        "--data_dir",
        default=None,
        help="folder of the official <dataset>.jsonl files (default: data/longbench, or the "
        "original's data/LongBench when only that exists)",
    )
    data.example = "data/longbench"
    parser.add_argument(
        "--datasets",
        nargs="+",
        default=None,
        help="datasets to run (default: all 21, or the 13 of LongBench-E with --e)",
    )
    parser.add_argument("--e", action="store_true", help="LongBench-E (<dataset>_e.jsonl)")
    parser.add_argument(
        "--hub",
        action="store_true",
        help="load missing files from the hub through `datasets` (needs network)",
    )
    return parser


def datasets_of(args):
    """The datasets to run: ``args.datasets`` or every one of LongBench (LongBench-E with ``--e``).

    Raises
    ------
    ValueError
        For a dataset that is not one of them.
    """
    allowed = LONGBENCH_E if args.e else DATASETS
    names = args.datasets or allowed
    unknown = [d for d in names if d not in allowed]
    if unknown:
        raise ValueError(f"--datasets: unknown {unknown}; choose from {allowed}")
    return names


def prepare(args):
    """Check the flags (``args.datasets`` by :func:`datasets_of`) and load the datasets of ``args`` before any
    model work (:func:`restkv.bench.datasets.prepare_datasets`)."""
    args.datasets = datasets_of(args)
    args.data_dir = args.data_dir or default_data_dir("data/longbench", "data/LongBench")
    name = "longbench_e" if args.e else "longbench"
    return prepare_datasets(
        args,
        name,
        lambda: [
            make_task(
                d, load_records(args.data_dir, d, args.e, args.max_num_examples, args.hub), args.e
            )
            for d in args.datasets
        ],
        {"benchmark": name},
    )


def run(args, plan=None):
    """Predict the datasets of ``args``; returns ``{(dataset, label): file}``."""
    return run_datasets(args, plan or prepare(args))
