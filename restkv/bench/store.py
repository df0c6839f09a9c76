"""Where a task's records go: a results file per label (labels may share one), opened for this process's
part of the run (:mod:`restkv.bench.shard`); a record already written is skipped."""

import os

from .shard import ResultFile


class Store:
    """Where the records of a task go: a results file per label (labels may share one).

    Parameters
    ----------
    paths : dict
        ``{label: results file}``.
    key_fields : sequence of str
        Record fields that identify a record in its file.
    key : callable
        ``key(unit, label) -> tuple``: the key values of the record of ``unit`` under ``label``.
    """

    def __init__(self, paths, key_fields, key):
        self.paths = dict(paths)
        self.key_fields = tuple(key_fields)
        self.key = key
        self._files = {}

    def plan(self, units):
        """``{file: keys}``: the keys of every record of ``units`` in each file, unit by unit, in label order."""
        plan = {path: [] for path in self.paths.values()}
        for unit in units:
            for label, path in self.paths.items():
                plan[path].append(self.key(unit, label))
        return plan

    def open(self, units, shard):
        """Open every file (or this process's part of it) for the records of ``units``."""
        self._files = {
            path: ResultFile(path, self.key_fields, keys, shard)
            for path, keys in self.plan(units).items()
        }

    def done(self, unit, label):
        """Whether the record of ``unit`` under ``label`` is already written."""
        return self._files[self.paths[label]].done(self.key(unit, label))

    def write(self, label, record):
        self._files[self.paths[label]].write(record)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files = {}


def per_label(folder, labels, field):
    """The :class:`Store` of ``<folder>/<label>.jsonl`` files, a record keyed by its unit's ``field``."""
    return Store(
        {label: os.path.join(folder, f"{label}.jsonl") for label in labels},
        (field,),
        lambda unit, label: (unit[field],),
    )
