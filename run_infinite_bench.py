"""Predict InfiniteBench tasks with any methods and budgets.

Example
-------
python run_infinite_bench.py --data_dir data/infinite_bench --tasks passkey kv_retrieval \\
    --method restkv snapkv fullkv --max_capacity_prompts 1024 --save_dir results/infinite_bench
"""

import argparse

from restkv.bench.cli import add_common_args
from restkv.bench.infinitebench.data import load_records
from restkv.bench.infinitebench.tasks import MAX_NEW_TOKENS, TASKS, answers, make_prompt
from restkv.bench.longbench.runner import Task, add_loop_args, run_tasks


def make_task(task, records, style="auto"):
    """The shared loop's :class:`Task` for one InfiniteBench task.

    ``style`` ``auto`` picks the chat templates when the chat template wraps
    the prompt and the base ones otherwise.
    """
    def text(record, chat):
        return make_prompt(record, task, style if style != "auto" else ("chat" if chat else "base"))

    return Task(
        name=task,
        records=records,
        text=text,
        output=lambda r: {"id": r["id"], "answers": answers(r, task)},
        max_new_tokens=MAX_NEW_TOKENS[task],
        chat=True,
        key="id",
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_loop_args(parser)
    parser.add_argument("--data_dir", default="data/infinite_bench", help="folder of the released <task>.jsonl files")
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS, metavar="TASK",
                        help=f"tasks to run (default: all): {' '.join(TASKS)}")
    parser.add_argument("--template", default="auto", choices=("auto", "chat", "base"),
                        help="official template set: chat (instructions) or base (answer cue); "
                             "auto: chat when the model's chat template is applied")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    tasks = [make_task(t, load_records(args.data_dir, t, args.max_num_examples), args.template) for t in args.tasks]
    return run_tasks(args, tasks, {"benchmark": "infinite_bench", "template": args.template})


if __name__ == "__main__":
    main()
