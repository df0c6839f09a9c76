"""The needle sweep: every (method x budget, needle, length, depth) record of a run (its flags: ``flags``)."""

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ...lazy import NotInstalled, require
from ..cli import check_backend, check_common
from ..grid import announce, configs_meta, method_configs
from ..loop import Predictor, Store, Task
from ..meta import check_args_rerun
from ..models import check_context, essays_dir, model_name
from ..ranges import parse_range, shown
from ..results import read_jsonl
from ...data.needles import PROMPT, Haystack, make_case
from .flags import (  # noqa: F401  (read from here too)
    NEEDLE_LENGTHS,
    add_needle_args,
    needles_from_args,
    original_lengths,
)
from .metrics import needle_kept, score

KEY_FIELDS = ("needle", "label", "config_id", "length", "depth")


def config_id(kwargs, settings):
    """Short hash of everything besides (needle, length, depth) that changes a record."""
    blob = json.dumps({"configure": kwargs, **settings}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


@dataclass
class NeedlePlan:
    """Everything a needle run checks before the model loads."""

    configs: list  # (label, configure kwargs)
    needles: list
    lengths: list
    depths: list
    haystack_dir: Path

    @property
    def cells(self):
        return [(n, L, d) for n in self.needles for L in self.lengths for d in self.depths]


def prepare(args):
    """Check the flags of a needle run and expand its grid, before any model work; print the grid and
    its record count (stderr).

    Raises
    ------
    ValueError
        Naming the flag: a bad config, needle, range, a depth outside 0-100, or a context length
        (``--max_length``) that does not fit the model's context with ``--max_new_tokens``.
    FileNotFoundError
        The haystack folder or the registry model is missing.
    restkv.lazy.MissingExtra
        The scorer (or the plots') package is not installed.
    """
    check_common(args)
    require(
        "rouge_score",
        *(() if args.no_plots else ("matplotlib",)),
        needed_by="the needle scores" + ("" if args.no_plots else " and plots (--no_plots: none)"),
    )
    configs = method_configs(args)
    needles = needles_from_args(args)
    lengths, flag = original_lengths(args)
    if lengths is None:
        lengths, flag = (
            parse_range(args.context_lengths, int, "--context_lengths"),
            "--context_lengths",
        )
    depths = parse_range(args.depth_percents, float, "--depth_percents")
    if any(L < 1 for L in lengths):
        raise ValueError(f"{flag} must be >= 1, got {shown(lengths)}")
    if any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"--depth_percents must lie in 0-100, got {shown(depths)}")
    try:
        haystack_dir = Path(args.haystack_dir) if args.haystack_dir else essays_dir()
    except NotInstalled as err:
        raise NotInstalled(f"{err} (or give --haystack_dir, a folder of .txt files)") from None
    if not haystack_dir.is_dir():
        raise FileNotFoundError(f"--haystack_dir: haystack folder {haystack_dir} does not exist")
    if next(haystack_dir.glob("*.txt"), None) is None:
        raise FileNotFoundError(f"--haystack_dir: haystack folder {haystack_dir} holds no .txt file")
    limit = check_context(
        args.model_path,
        [
            (flag, max(lengths), args.max_new_tokens),
            ("--max_length", args.max_length, args.max_new_tokens),
        ],
    )
    check_args_rerun(args, configs, record_settings(args, haystack_dir, limit))
    check_shortest(args, needles, min(lengths), flag, haystack_dir)
    check_backend(args)
    plan = NeedlePlan(configs, needles, lengths, depths, haystack_dir)
    print(f"needle: context lengths {shown(lengths)}; depths (%) {shown(depths)}", file=sys.stderr)
    announce(
        "needle",
        [("needles", len(needles)), ("lengths", len(lengths)), ("depths", len(depths))],
        configs,
    )
    return plan


def check_shortest(args, needles, length, flag, haystack_dir):
    """Build each needle's prompt of the shortest ``length`` (the model's tokenizer, no model): ``ValueError``
    naming ``flag`` when it leaves no room for the haystack."""
    from ..ruler.generate import load_tokenizer

    tokenizer = load_tokenizer(args.model_path)
    haystack = Haystack(tokenizer, haystack_dir)
    for needle in needles:
        try:
            make_case(tokenizer, haystack, needle, length, 0, args.chat_template, None, args.seed)
        except ValueError as err:
            raise ValueError(f"{flag}: {err} (the {needle.name} needle's prompt: template, question "
                             "and needle)") from None


def record_settings(args, haystack_dir, context):
    """Everything besides a config's knobs and (needle, length, depth) that changes a record (in its
    :func:`config_id`), ``context`` being the model's max context: a rerun into a folder must match them."""
    settings = {
        "model": model_name(args.model_path),
        "chat_template": args.chat_template,
        "max_length": args.max_length or context - args.max_new_tokens,
        "max_new_tokens": args.max_new_tokens,
        "haystack": str(haystack_dir),
        "seed": args.seed,
        "dtype": args.dtype,
        "attn_implementation": args.attn_implementation,
        "prompt": PROMPT,
    }
    if getattr(args, "query_agnostic", False):
        settings["query_agnostic"] = True  # records of the two modes never share a config_id
    return settings


def run(args, plan=None):
    """Run every (method x budget, needle, length, depth) record not yet in the results file.

    The records of all configs go to one file, ``<save_dir>/<model>/results.jsonl``, cell by cell
    in config order; a record is keyed by its config's :func:`config_id` too. A rerun into a folder whose
    results were made with other settings (:func:`record_settings`) is refused by :func:`prepare`.

    Parameters
    ----------
    args : argparse.Namespace
    plan : NeedlePlan, optional
        :func:`prepare`'s result (computed here when not given).

    Returns
    -------
    (str, list of dict)
        The results file and the records of this configuration (old and new); no records on
        the other processes of a sharded run.
    """
    plan = plan or prepare(args)
    configs, needles, lengths, depths, haystack_dir = (
        plan.configs,
        plan.needles,
        plan.lengths,
        plan.depths,
        plan.haystack_dir,
    )
    predictor = Predictor(args, configs)
    tokenizer = predictor.tokenizer
    model = predictor.name
    cap = args.max_length or predictor.max_length - args.max_new_tokens
    haystack = Haystack(tokenizer, haystack_dir)
    settings = record_settings(args, haystack_dir, predictor.max_length)
    ids = {label: config_id(kw, settings) for label, kw in configs}
    predictor.write_metadata(
        {
            "benchmark": "needle",
            "labels": ids,
            "settings": settings,
            "configs": configs_meta(configs),
            "max_length": cap,
            "lengths": lengths,
            "depths": depths,
            "needles": [asdict(n) for n in needles],
            "processes": predictor.shard.size,
        }
    )
    path = os.path.join(predictor.out_dir, "results.jsonl")

    def prompt(cell):
        n, L, d = cell
        return make_case(tokenizer, haystack, n, L, d, args.chat_template, cap, args.seed)

    def record(cell, case, out):
        n, L, d = cell
        return {
            "needle": n.name,
            "label": out.label,
            "config_id": ids[out.label],
            "length": L,
            "depth": d,
            "method": out.kwargs["method"],
            "budget": out.kwargs.get("max_capacity_prompt"),
            **(
                {"budget_ratio": out.kwargs["max_capacity_prompt_ratio"]}
                if "max_capacity_prompt_ratio" in out.kwargs
                else {}
            ),
            "quant": predictor.quant[out.label],
            "model": model,
            "prompt_tokens": len(case.ids),
            "needle_span": case.needle_span,
            "truncated": case.truncated,
            "answer": case.answer,
            "response": out.text,
            **score(out.text, case.needle_text, case.answer),
            "needle_kept": needle_kept(out.kept, case.needle_span, out.row),
            "seconds": round(out.seconds, 3),
        }

    store = Store(
        {label: path for label in predictor.labels},
        KEY_FIELDS,
        lambda cell, label: (cell[0].name, label, ids[label], cell[1], cell[2]),
    )
    cells = plan.cells
    predictor.predict(
        [
            Task(
                "needle",
                cells,
                prompt,
                record,
                args.max_new_tokens,
                store,
                ids=_case_ids,
                progress={"unit": "cell"},
                announce=True,
                question_start=_question_start,
            )
        ]
    )
    if not predictor.shard.main:
        return path, []
    grid = {(n.name, L, d) for n, L, d in cells}
    records = [
        r
        for r in read_jsonl(path)
        if ids.get(r["label"]) == r["config_id"] and (r["needle"], r["length"], r["depth"]) in grid
    ]
    return path, records


def _case_ids(case):
    return case.ids


def _question_start(case):
    return case.question_start
