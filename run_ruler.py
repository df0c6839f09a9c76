"""Predict RULER tasks with any methods and budgets.

Reads folders of ``<task>/validation.jsonl`` (made by ``python -m
restkv.bench.ruler.generate`` or by RULER's own scripts) and appends predictions
to ``<save_dir>/<model>/<max_seq_length>/<task>/<label>.jsonl``; records already
there are skipped. Each batch is prefilled once for every method x budget
(``--no_sweep``: once per config). Under ``accelerate launch`` the samples
(numbered over all tasks) are sharded over the processes and the main process
merges their parts (see :mod:`restkv.bench.shard`).

Folders from RULER's own ``prepare.py`` (``.../synthetic/4096/data``) lack
``max_seq_length``: pass ``--context_length 4096``; when they were made with a
model template already in ``input``, add ``--chat_template off``.

Example
-------
python run_ruler.py --data_dir data/ruler/smollm2-135m/4096 --method restkv snapkv fullkv \\
    --max_capacity_prompts 128 256 512 --save_dir results/ruler
"""

import argparse
import os

from tqdm import tqdm

from restkv.bench.cli import add_common_args
from restkv.bench.generation import decode_configs
from restkv.bench.grid import configs_meta, method_configs
from restkv.bench.meta import write_metadata
from restkv.bench.models import load_from_args, model_name
from restkv.bench.prompts import build_prompt, encode, middle_truncate
from restkv.bench.ruler.data import find_tasks, load_task
from restkv.bench.ruler.tasks import FAMILIES, family_of
from restkv.bench.shard import ResultFile, current

KEPT = ("index", "outputs", "length", "max_seq_length", "answer_prefix")


def prompt_ids(tokenizer, record, chat_template, cap):
    """Token ids of chat(input) + answer prefix, the input middle-truncated to fit ``cap``.

    Returns
    -------
    tuple of (list of int, bool)
        Ids and whether the input was truncated.
    """
    text = record["input"]
    ids = encode(tokenizer, build_prompt(tokenizer, text, chat_template) + record["answer_prefix"])
    excess = len(ids) - cap
    if excess <= 0:
        return ids, False
    body = tokenizer(text, add_special_tokens=False).input_ids
    if excess >= len(body):
        raise ValueError(f"record {record['index']}: prompt exceeds {cap} tokens even without its input")
    text = tokenizer.decode(middle_truncate(body, len(body) - excess), skip_special_tokens=True)
    return encode(tokenizer, build_prompt(tokenizer, text, chat_template) + record["answer_prefix"]), True


def load_data(data_dirs, tasks, num_samples, context_length):
    """``[(task, records)]`` of every data folder, validated before any model work.

    Raises
    ------
    ValueError
        When two folders hold the same task at the same length (they would share a results file).
    """
    out, seen = [], {}
    for data_dir in data_dirs:
        names = tasks or find_tasks(data_dir)
        for task in names:
            family_of(task)
            path = os.path.join(data_dir, task, "validation.jsonl")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: missing (task {task} in data_dir {data_dir})")
            records = load_task(path, context_length)[:num_samples]
            where = (records[0]["max_seq_length"], task)
            if where in seen:
                raise ValueError(f"{path}: task {task} at length {where[0]} is also in {seen[where]}")
            seen[where] = path
            out.append((task, records))
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--data_dir", nargs="+", required=True,
                        help="one or more folders of <task>/validation.jsonl (e.g. one per length)")
    parser.add_argument("--tasks", nargs="+", default=None, help="tasks to run (default: every task folder)")
    parser.add_argument("--num_samples", type=int, default=None, help="first N samples of each task only")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="override RULER's tokens to generate (niah 128, cwe 120, fwe 50, qa 32, vt 30)")
    parser.add_argument("--context_length", type=int, default=None,
                        help="requested length of files lacking max_seq_length (RULER's own output)")
    return parser.parse_args(argv)


def run(args, data):
    """Predict every sample of ``data`` for every method x budget of ``args``.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed :func:`parse_args` flags.
    data : list of (str, list of dict)
        Tasks and their records, as :func:`load_data` returns them.

    Returns
    -------
    dict
        ``{(max_seq_length, task, label): predictions file}``.
    """
    configs = method_configs(args)
    shard = current()
    model, tokenizer, max_length = load_from_args(args, shard)
    name = model_name(args.model_path)
    out_dir = os.path.join(args.save_dir, name)
    if shard.main:
        write_metadata(out_dir, args, {"benchmark": "ruler", "labels": [c[0] for c in configs],
                                       "configs": configs_meta(configs), "tasks": sorted({t for t, _ in data}),
                                       "max_length": max_length, "processes": shard.size})
    files, first = {}, 0
    for task, records in data:
        new_tokens = args.max_new_tokens or FAMILIES[family_of(task)]["tokens_to_generate"]
        length = records[0]["max_seq_length"]
        plan = [(r["index"],) for r in records]
        outs = {}
        for label, _ in configs:
            files[(length, task, label)] = path = os.path.join(out_dir, str(length), task, f"{label}.jsonl")
            outs[label] = ResultFile(path, ("index",), plan, shard)
        try:
            def todo(record):
                return [label for label, _ in configs if not outs[label].done((record["index"],))]

            mine = [r for i, r in enumerate(records, first) if shard.mine(i) and todo(r)]
            first += len(records)
            for start in tqdm(range(0, len(mine), args.batch_size), desc=f"{length} {task}", leave=False):
                batch = mine[start:start + args.batch_size]
                left = {label for r in batch for label in todo(r)}
                need = [(label, kw) for label, kw in configs if label in left]
                prompts = [prompt_ids(tokenizer, r, args.chat_template, max_length - new_tokens) for r in batch]
                results = decode_configs(model, tokenizer, [ids for ids, _ in prompts], [kw for _, kw in need],
                                         new_tokens, sweep=not args.no_sweep)
                for (label, _), (preds, _) in zip(need, results):
                    for record, pred, (ids, cut) in zip(batch, preds, prompts):
                        if not outs[label].done((record["index"],)):
                            outs[label].write({**{k: record[k] for k in KEPT}, "task": task, "method": label,
                                               "model": name, "pred": pred, "prompt_tokens": len(ids),
                                               "truncated": cut})
        finally:
            for out in outs.values():
                out.close()
    shard.finish(files.values())
    return files


def main(argv=None):
    args = parse_args(argv)
    method_configs(args)  # flag errors before any data or model work
    return run(args, load_data(args.data_dir, args.tasks, args.num_samples, args.context_length))


if __name__ == "__main__":
    main()
