"""Sharding a run over the processes of ``accelerate launch``.

Every runner enumerates its units of work (needle cells, dataset records) in one fixed order;
process ``rank`` of ``size`` takes the units whose index is ``rank`` modulo ``size``. A results
file ``<name>.jsonl`` of a sharded run is written as one part per process,
``<name>.jsonl.part-<rank>-of-<size>``, beside ``<name>.jsonl.plan`` (the file's key fields and
the keys of the run in single-process order). Once every process is done, the main process merges
the parts into ``<name>.jsonl``: the records already there first, then the new ones in plan order,
exactly the file a single process writes. The same merge runs from the command line::

    python -m restkv.bench.shard merge <folder>

A process that is killed leaves its part behind; rerunning the launch skips the records present in
the results file or in the process's own part, so each shard only completes what it lacks.
"""

import argparse
import datetime
import glob
import json
import os
import sys
from dataclasses import dataclass

from .results import Closing, JsonlWriter, atomic_write, record_key

# How long the main process waits for the slowest shard before merging.
BARRIER_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Shard:
    """Process ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1

    @property
    def main(self):
        return self.rank == 0

    def mine(self, index):
        """Whether unit ``index`` (in the run's fixed order) belongs to this process."""
        return index % self.size == self.rank

    def barrier(self):
        """Wait until every process reaches this point (no-op for a single process)."""
        if self.size > 1:
            from accelerate import PartialState

            PartialState().wait_for_everyone()

    def finish(self, paths):
        """After every process is done, the main process merges the parts of ``paths`` into each file."""
        if self.size > 1:
            self.barrier()
            if self.main:
                for path in paths:
                    merge(path)


WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def current():
    """This process's :class:`Shard`: from ``accelerate.PartialState`` under a multi-process launch, else ``Shard()``.

    Without a GPU the processes join a CPU (gloo) process group.
    """
    if max(int(os.environ.get(v, "1")) for v in WORLD_SIZE_VARS) <= 1:
        return Shard()
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available(), timeout=BARRIER_TIMEOUT)
    return Shard(state.process_index, state.num_processes)


def part_path(path, shard):
    return f"{path}.part-{shard.rank:03d}-of-{shard.size:03d}"


def plan_path(path):
    return f"{path}.plan"


def _complete_lines(path):
    """Records of ``path`` up to its last newline (a write cut short is ignored); none if it is missing."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")[:-1]
    out = []
    for lineno, raw in enumerate(lines, 1):
        if raw.strip():
            try:
                out.append(json.loads(raw))
            except ValueError as err:
                raise ValueError(f"{path}:{lineno}: malformed record ({err})") from None
    return out


class ResultFile(Closing):
    """The results file of one run as this process writes it: the file itself, or its part.

    Parameters
    ----------
    path : str
        The results file.
    key_fields : sequence of str
        Record fields that identify one record.
    plan : list of tuple
        Key values of every record of the run, in single-process order (stored for the merge).
    shard : Shard
    """

    def __init__(self, path, key_fields, plan, shard):
        self.path = str(path)
        self.key_fields = tuple(key_fields)
        self.shard = shard
        if shard.size == 1:
            merge(self.path)  # parts left by an earlier sharded run count as done
            self.merged = set()
            self.writer = JsonlWriter(self.path, self.key_fields)
            return
        if shard.main:
            atomic_write(
                plan_path(self.path),
                json.dumps({"key_fields": self.key_fields, "keys": [list(k) for k in plan]}),
            )
        self.merged = {record_key(self.key_fields, r) for r in _complete_lines(self.path)}
        self.writer = JsonlWriter(part_path(self.path, shard), self.key_fields)

    def done(self, key):
        """Whether the record with these key values is in the results file or this process's part."""
        return record_key(self.key_fields, key) in self.merged or self.writer.done(key)

    def write(self, record):
        self.writer.write(record)

    def close(self):
        self.writer.close()


def merge(path):
    """Merge the parts of results file ``path`` into it and remove them (and the plan).

    Records already in ``path`` stay first, as they are; then every part record not yet there,
    in plan order (records missing from the plan last, in part order). A record present twice
    is kept once.

    Returns
    -------
    int
        Records added.
    """
    parts = sorted(glob.glob(glob.escape(path) + ".part-*-of-*"))
    if not parts:
        return 0
    plan_file = plan_path(path)
    if not os.path.exists(plan_file):
        raise FileNotFoundError(f"{plan_file} is missing: cannot order the parts of {path}")
    with open(plan_file, encoding="utf-8") as fh:
        plan = json.load(fh)
    fields = plan["key_fields"]
    order = {json.dumps(k): i for i, k in enumerate(plan["keys"])}
    existing = _complete_lines(path)
    seen = {record_key(fields, r) for r in existing}
    new = []
    for part in parts:
        for r in _complete_lines(part):
            k = record_key(fields, r)
            if k not in seen:
                seen.add(k)
                new.append((order.get(k, len(order)), len(new), r))
    new.sort(key=lambda t: t[:2])
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in existing + [r for *_, r in new]]
    atomic_write(path, "".join(lines))
    for f in parts + [plan_file]:
        os.remove(f)
    return len(new)


def merge_all(folder):
    """Merge every sharded results file under ``folder``; returns ``{path: records added}``."""
    bases = set()
    for part in glob.glob(os.path.join(glob.escape(folder), "**", "*.part-*-of-*"), recursive=True):
        bases.add(part[: part.rindex(".part-")])
    return {base: merge(base) for base in sorted(bases)}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m restkv.bench.shard", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser(
        "merge", help="merge the per-process parts of every results file under a folder"
    )
    m.add_argument("folder")
    args = parser.parse_args(argv)
    merged = merge_all(args.folder)
    for path, added in merged.items():
        print(f"{path}: {added} records merged")
    if not merged:
        print(f"no parts under {args.folder}", file=sys.stderr)
    return merged


if __name__ == "__main__":
    main()
