"""Generate RULER data offline, sized with the target tokenizer.

Writes ``<out_dir>/<length>/<task>/validation.jsonl``; each line holds ``index``,
``input`` (the prompt without answer prefix), ``outputs``, ``length`` (prompt
tokens with answer prefix, plus the task's tokens to generate, as in RULER),
``answer_prefix`` and ``max_seq_length`` (the requested length). Each sample
takes the largest haystack that fits, so ``length`` falls short of the request
by less than one haystack unit (an essay word, a list entry, a noise paragraph
or a distractor needle: up to ~85 tokens for UUID needles with SmolLM2).

python -m restkv.bench.ruler.generate --model_path smollm2-135m --lengths 4096 \
    --tasks synthetic --num_samples 20 --out_dir data/ruler/smollm2-135m
"""

import argparse
import itertools
import json
import re
import sys
from pathlib import Path
from random import Random

from restkv.bench.cli import ArgumentParser, startup
from restkv.bench.models import check_context

from restkv.bench.ruler import cwe, fwe, niah, qa, vt
from restkv.bench.ruler.sizing import largest_fitting
from restkv.bench.ruler.tasks import FAMILIES, SYNTHETIC, TASKS


def _makers(task, max_seq_length, seed, count, qa_file):
    """Yield ``(make, minimum, maximum)`` per candidate sample; ``make(size)`` builds it."""
    family, args = TASKS[task]
    key = f"{seed}:{task}"
    if family == "niah":
        lo = niah.minimum_size(args["haystack"], args["num_k"], args["num_v"], args["num_q"])
        hi = niah.maximum_size(args["haystack"])
        for i in itertools.count():
            yield (lambda n, i=i: niah.build(Random(f"{key}:{i}"), n, **args)), lo, hi
    elif family == "vt":
        example, used = _vt_example(key, args, count)
        for i in itertools.count():
            yield (
                (
                    lambda n, i=i: vt.build(
                        Random(f"{key}:{i}"), n, **args, example=example, exclude=used
                    )
                ),
                vt.MINIMUM_SIZE,
                None,
            )
    elif family == "cwe":
        lo = cwe.minimum_size(args["num_cw"])
        hi = cwe.maximum_size(max_seq_length)
        for i in itertools.count():
            yield (
                (lambda n, i=i: cwe.build(Random(f"{key}:{i}"), n, max_seq_length, **args)),
                lo,
                hi,
            )
    elif family == "fwe":
        for i in itertools.count():
            yield (
                (lambda n, i=i: fwe.build(Random(f"{key}:{i}"), n, max_seq_length, **args)),
                1,
                None,
            )
    else:
        questions, docs = qa.READERS[args["dataset"]](qa_file)
        for i, question in enumerate(questions):
            near = set(question["gold"]) | set(question["more"])
            others = [d for d in range(len(docs)) if d not in near]
            hi = len(question["gold"]) + len(question["more"]) + len(others)
            yield (
                (
                    lambda n, i=i, q=question, o=others: qa.build(
                        Random(f"{key}:{i}"), n, q, docs, o
                    )
                ),
                len(question["gold"]),
                hi,
            )


def _vt_example(key, args, count):
    """RULER's worked vt example (3-letter names, answer filled in) and the values it uses."""
    hops = min(10, args["num_hops"])
    make = lambda n: vt.build(Random(f"{key}:example"), n, args["num_chains"], hops, name_length=3)
    budget = vt.EXAMPLE_LENGTH - FAMILIES["vt"]["tokens_to_generate"]
    size = largest_fitting(lambda n: count("".join(make(n)[:2])) <= budget, 1, vt.MINIMUM_SIZE)
    prompt, prefix, answer = make(size)
    example = prompt + prefix + " ".join(answer) + "\n\n"
    return example, re.findall(r"\b\d{5}\b", example)


def generate(task, tokenizer, max_seq_length, num_samples, seed=42, qa_file=None):
    """Samples of one task at one length.

    Parameters
    ----------
    task : str
        A name from ``TASKS``.
    tokenizer : transformers tokenizer
        Tokenizer of the target model.
    max_seq_length : int
        Prompt tokens plus the task's tokens to generate, at most.
    num_samples : int
    seed : int
        Same seed, same samples.
    qa_file : str or Path, optional
        SQuAD/HotpotQA JSON for the qa tasks.

    Returns
    -------
    list of dict
    """
    family = TASKS[task][0]
    new_tokens = FAMILIES[family]["tokens_to_generate"]
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    records = []
    guess = 1
    skipped = 0
    for make, lo, hi in _makers(task, max_seq_length, seed, count, qa_file):
        if len(records) == num_samples:
            break
        fits = lambda n: count("".join(make(n)[:2])) + new_tokens <= max_seq_length
        try:
            size = largest_fitting(fits, guess, lo, hi)
        except ValueError:
            if family != "qa":
                raise ValueError(
                    f"{task}: max_seq_length={max_seq_length} is too small for the smallest sample"
                ) from None
            skipped += 1
            continue
        if size == hi and family != "qa":
            raise ValueError(
                f"{task}: the haystack runs out ({hi} units) before max_seq_length={max_seq_length}"
            )
        prompt, prefix, outputs = make(size)
        records.append(
            {
                "index": len(records),
                "input": prompt,
                "outputs": outputs,
                "length": count(prompt + prefix) + new_tokens,
                "answer_prefix": prefix,
                "max_seq_length": max_seq_length,
            }
        )
        guess = size
    if len(records) < num_samples:
        raise ValueError(
            f"{task}: only {len(records)} of {num_samples} questions fit in "
            f"max_seq_length={max_seq_length} ({skipped} too long)"
        )
    return records


def write_task(records, path):
    """Write records as JSONL (via a temporary file, so a partial file never remains)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)


def load_tokenizer(model_path):
    """Tokenizer of a registry model, local checkpoint or hub id."""
    from transformers import AutoTokenizer

    from restkv.bench.models import resolve

    return AutoTokenizer.from_pretrained(resolve(model_path))


def parse_tasks(values):
    """Expand ``all``/``synthetic`` and comma lists into known task names."""
    names = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            group = list(TASKS) if name == "all" else SYNTHETIC if name == "synthetic" else [name]
            names += [n for n in group if n and n not in names]
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(
            f"--tasks: unknown {unknown}; choose from all, synthetic, {', '.join(TASKS)}"
        )
    return names


def check(args):
    """The checks of the command line before any work: ``(task names, {dataset: qa file})``.

    Raises
    ------
    ValueError
        Naming the flag: an unknown task, a length below 64 or beyond the model's context (read from its
        config or GGUF metadata, not its weights), a missing or malformed qa file.
    """
    tasks = parse_tasks(args.tasks)
    if any(n < 64 for n in args.lengths):
        raise ValueError(f"--lengths must be >= 64, got {min(args.lengths)}")
    if args.num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {args.num_samples}")
    qa_files = {"squad": args.squad, "hotpotqa": args.hotpotqa}
    for task in tasks:
        family, task_args = TASKS[task]
        if family == "qa":
            dataset = task_args["dataset"]
            path = qa_files[dataset]
            if not path or not Path(path).is_file():
                raise ValueError(
                    f"--{dataset}: {task} needs a local {qa.FORMATS[dataset]}; pass --{dataset} PATH "
                    f"(given: {path or 'nothing'})"
                )
            qa.READERS[dataset](path)  # a malformed file fails here, before any work
    check_context(args.model_path, [("--lengths", max(args.lengths), 0)])
    print(
        f"ruler data: {len(tasks)} tasks x {len(args.lengths)} lengths x {args.num_samples} samples = "
        f"{len(tasks) * len(args.lengths) * args.num_samples} records",
        file=sys.stderr,
    )
    return tasks, qa_files


def main(argv=None):
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model_path", default="smollm2-135m", help="tokenizer source: registry name or path"
    )
    parser.add_argument(
        "--lengths", nargs="+", type=int, default=[4096], help="max_seq_length values"
    )
    parser.add_argument(
        "--tasks", nargs="+", default=["synthetic"], help="task names, 'synthetic' or 'all'"
    )
    parser.add_argument("--num_samples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--squad", help="local SQuAD JSON for qa_1")
    parser.add_argument("--hotpotqa", help="local HotpotQA JSON for qa_2")
    args = parser.parse_args(argv)
    tasks, qa_files = startup(parser, check, args)
    tokenizer = load_tokenizer(args.model_path)
    for length in args.lengths:
        for task in tasks:
            family, task_args = TASKS[task]
            qa_file = qa_files.get(task_args.get("dataset"))
            records = generate(task, tokenizer, length, args.num_samples, args.seed, qa_file)
            path = Path(args.out_dir) / str(length) / task / "validation.jsonl"
            write_task(records, path)
            lengths = [r["length"] for r in records]
            print(
                f"{path}: {len(records)} samples, length {min(lengths)}-{max(lengths)}", flush=True
            )


if __name__ == "__main__":
    main()
