"""The prediction loop every runner shares.

A runner describes its work as :class:`Task` objects: the units (dataset records, needle cells)
in the run's fixed order, how to build a unit's prompt and its record, and a :class:`Store` that
says where each (unit, label) record goes. :class:`Predictor` loads the model once and, per task,
decodes the units greedily in batches under every method x budget that still lacks their record
(one prefill per batch; ``--no_sweep``: one per config) and appends the records, unit by unit and
in config order. Records already written are skipped, so a rerun resumes. Every record says whether
the prefill evicted entries of its prompt (``prompt_evicted``: false when the budget holds the whole
prompt), and a run where a budget held prompts whole ends with one line counting them per config.
With ``--query_agnostic`` each prompt's context is compressed before its question is read (each task
says where its question starts: ``Task.question_start``); the mode is in the run metadata and every
record. Under ``accelerate launch`` the units, numbered over all tasks, are sharded over the
processes and the main process merges their parts (see :mod:`restkv.bench.shard`). A task and its outputs
are declared in :mod:`restkv.bench.task`, its records' files in :mod:`restkv.bench.store`.
"""

import os
import sys
import time

from tqdm import tqdm

from ..strategies.budgets import keeps_prompt
from .cli import TABULATE, run_settings
from .generation import decode_configs
from .grid import quant_of, run_config
from .meta import write_metadata
from .models import load_from_args, model_name
from .shard import current
from .store import Store, per_label  # noqa: F401  (read from here too)
from .task import QUESTION_START, Output, Task  # noqa: F401


def unevicted_line(whole):
    """The run's last line when a budget held prompts whole (``whole``: ``{label: [whole, run]}``):
    ``budget >= prompt length, nothing evicted at prefill (...): snapkv_4096 6 of 6 prompts, ...``;
    ``""`` when every prompt was evicted."""
    shown = [f"{label} {n} of {total} prompt{'s' * (total != 1)}" for label, (n, total) in whole.items() if n]
    if not shown:
        return ""
    return (
        "budget >= prompt length, nothing evicted at prefill (these records are the full cache's): "
        + ", ".join(shown)
    )


def check_against_model(model, configs):
    """Each config's layer plan on the loaded model (its layers, backend, sliding windows), before any prompt
    runs: a config the model cannot hold ends the run with one line naming its label (exit code 1)."""
    from ..integration.calibration import layer_plans  # torch: not before a model is loaded

    for run in map(run_config, configs):
        if run.cfg.evicts:
            try:
                layer_plans(
                    model, run.cfg
                )  # HeadKV's own head scores computed here (once) when it has no file
            except ValueError as err:
                raise SystemExit(f"{run.label}: {err}") from None


class Predictor:
    """The model of a run and its output folder: loads the model for the configs of ``args``.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed :func:`restkv.bench.cli.add_common_args` flags.
    configs : list of (str, dict)
        ``restkv.bench.grid.method_configs(args)``.

    Attributes
    ----------
    labels : list of str
        The labels of ``configs``, in order.
    quant : dict
        ``{label: KV quantization}`` (:func:`restkv.bench.grid.quant_settings`; None: full precision).
    shard, model, tokenizer, max_length
        This process's shard, the model and tokenizer, and ``args.max_length`` or the model's max context.
    name, out_dir : str
        The model's folder name and ``<save_dir>/<name>`` (``<save_dir>/<model_version>`` with the needle
        runner's ``--model_version``).
    """

    def __init__(self, args, configs):
        self.args = args
        self.configs = [run_config(c) for c in configs]
        self.labels = [run.label for run in self.configs]
        self.quant = {run.label: quant_of(run.cfg) for run in self.configs}
        self.shard = current()
        self.model, self.tokenizer, self.max_length = load_from_args(args, self.shard)
        check_against_model(self.model, configs)
        self.name = model_name(args.model_path)
        self.out_dir = os.path.join(
            args.save_dir, getattr(args, "model_version", None) or self.name
        )
        self.settings = run_settings(
            args
        )  # in every record (and, when not the defaults, in its label)
        self.whole = {}  # {label: [prompts held whole, prompts run]} of the evicting configs

    @property
    def query_agnostic(self):
        return bool(getattr(self.args, "query_agnostic", False))

    def write_metadata(self, extra):
        """``run_meta.json`` of the run with ``extra`` and its question mode (main process only)."""
        mode = {"query_agnostic": self.query_agnostic}
        if self.query_agnostic:
            mode["question_start"] = QUESTION_START
        if self.shard.main:
            write_metadata(self.out_dir, self.args, {**extra, **mode})

    def say_where(self, benchmark):
        """Print (main process) where the run's results are and the command that scores them
        (:data:`restkv.bench.cli.TABULATE`)."""
        if self.shard.main and benchmark in TABULATE:
            score = TABULATE[benchmark].format(path=self.args.save_dir)
            print(f"\nresults: {self.out_dir}\nscore them with: {score}")

    def predict(self, tasks):
        """Write every missing record of ``tasks``, then merge the processes' parts of every file."""
        paths = []
        first = 0
        for task in tasks:
            self._predict(task, first)
            first += len(task.units)
            paths += [p for p in dict.fromkeys(task.store.paths.values()) if p not in paths]
        self.shard.finish(paths)
        line = unevicted_line(self.whole)
        if line:
            print(line, file=sys.stderr)

    def _predict(self, task, first):
        store, shard, batch_size, agnostic = (
            task.store,
            self.shard,
            self.args.batch_size,
            self.query_agnostic,
        )
        if agnostic and task.question_start is None:
            raise ValueError(
                f"--query_agnostic: task {task.name} does not say where its questions start"
            )
        store.open(task.units, shard)
        bar = None
        try:

            def todo(unit):
                return [run for run in self.configs if not store.done(unit, run.label)]

            mine = [u for i, u in enumerate(task.units, first) if shard.mine(i) and todo(u)]
            if task.announce:
                where = f" (process {shard.rank} of {shard.size})" if shard.size > 1 else ""
                print(
                    f"{task.name}{where}: {sum(len(todo(u)) for u in mine)} records to run",
                    file=sys.stderr,
                )
            bar = tqdm(total=len(mine), desc=task.name, **task.progress)
            for start in range(0, len(mine), batch_size):
                batch = mine[start : start + batch_size]
                left = {run.label for u in batch for run in todo(u)}
                need = [run for run in self.configs if run.label in left]
                prompts = [task.prompt(u) for u in batch]
                starts = [task.question_start(p) for p in prompts] if agnostic else None
                t0 = time.time()
                results = (task.decode or decode_configs)(
                    self.model,
                    self.tokenizer,
                    [task.ids(p) for p in prompts],
                    [run.cfg for run in need],
                    task.max_new_tokens,
                    sweep=not self.args.no_sweep,
                    **({"question_starts": starts} if agnostic else {}),
                )
                seconds = (time.time() - t0) / (len(batch) * len(need))
                for row, (unit, prompt) in enumerate(zip(batch, prompts)):
                    # the tokens eviction sees: the prompt, or its context with --query_agnostic
                    length = starts[row] if agnostic else len(task.ids(prompt))
                    for run, (texts, kept) in zip(need, results):
                        label, kw = run
                        if not store.done(unit, label):
                            output = Output(label, kw, texts[row], kept, row, seconds)
                            evicted = not keeps_prompt(run.cfg, length)
                            if run.cfg.evicts:
                                count = self.whole.setdefault(label, [0, 0])
                                count[0] += not evicted
                                count[1] += 1
                            record = {
                                **task.record(unit, prompt, output),
                                **self.settings,
                                "prompt_evicted": evicted,
                            }
                            if agnostic:
                                record = {
                                    **record,
                                    "query_agnostic": True,
                                    "question_start": starts[row],
                                }
                            store.write(label, record)
                bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()  # Ctrl-C too: drawn once before the run's last line, never again after it
            store.close()
