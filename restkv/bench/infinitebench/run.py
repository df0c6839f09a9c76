"""Predicting InfiniteBench: the flags and the run of ``run_infinite_bench.py``."""

from ..cli import add_tasks_arg
from ..datasets import Dataset, default_data_dir, prepare_datasets, run_datasets
from .data import load_records
from .tasks import MAX_NEW_TOKENS, TASKS, answers, make_prompt, question_text


def make_task(task, records, style="auto"):
    """The :class:`restkv.bench.datasets.Dataset` of one InfiniteBench task.

    ``style`` ``auto`` picks the chat templates when the chat template wraps
    the prompt and the base ones otherwise.
    """

    def text(record, chat):
        return make_prompt(record, task, style if style != "auto" else ("chat" if chat else "base"))

    def question(record, chat):
        return question_text(
            record, task, style if style != "auto" else ("chat" if chat else "base")
        )

    return Dataset(
        name=task,
        records=records,
        text=text,
        output=lambda r: {"id": r["id"], "answers": answers(r, task)},
        max_new_tokens=MAX_NEW_TOKENS[task],
        chat=True,
        key="id",
        question=question,
    )


def add_infinitebench_args(parser):
    """Flags of the InfiniteBench data (besides :func:`restkv.bench.cli.add_dataset_args`)."""
    data = parser.add_argument(
        "--data_dir",
        default=None,
        help="folder of the released <task>.jsonl files (default: data/infinite_bench, or the "
        "original's data/InfiniteBench when only that exists)",
    )
    data.example = "data/infinite_bench"
    add_tasks_arg(parser, TASKS)
    parser.add_argument(
        "--template",
        default="auto",
        choices=("auto", "chat", "base"),
        help="official template set: chat (instructions) or base (answer cue); "
        "auto: chat when the model's chat template is applied",
    )
    return parser


def prepare(args):
    """Check the flags and load the tasks of ``args`` before any model work
    (:func:`restkv.bench.datasets.prepare_datasets`)."""
    args.data_dir = args.data_dir or default_data_dir("data/infinite_bench", "data/InfiniteBench")
    return prepare_datasets(
        args,
        "infinite_bench",
        lambda: [
            make_task(t, load_records(args.data_dir, t, args.max_num_examples), args.template)
            for t in args.tasks
        ],
        {"benchmark": "infinite_bench", "template": args.template},
    )


def run(args, plan=None):
    """Predict the tasks of ``args``; returns ``{(task, label): predictions file}``."""
    return run_datasets(args, plan or prepare(args))
