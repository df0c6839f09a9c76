"""Results files: resumable JSONL writing, record keys, and reading JSONL data and results."""

import json
import os

from ..integration.files import atomic_write, new_file_mode  # noqa: F401 (re-exported)


class Closing:
    """A context manager that calls ``self.close()`` on exit."""

    def close(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def record_key(fields, record_or_key):
    """The key of a record (a dict) or of key values (a tuple, list or single value) under ``fields``,
    as a string that compares equal for equal keys.

    Raises
    ------
    KeyError
        A record that lacks a key field.
    ValueError
        Key values that do not match ``fields`` in number.
    """
    if isinstance(record_or_key, dict):
        missing = [f for f in fields if f not in record_or_key]
        if missing:
            raise KeyError(f"record lacks key fields {missing}")
        values = [record_or_key[f] for f in fields]
    else:
        values = (
            list(record_or_key) if isinstance(record_or_key, (tuple, list)) else [record_or_key]
        )
        if len(values) != len(fields):
            raise ValueError(f"key {record_or_key!r} does not match key fields {list(fields)}")
    return json.dumps(values)


class JsonlWriter(Closing):
    """Append-only JSONL results file that resumes where a previous run stopped.

    On open, the keys of the records already in ``path`` are loaded. Every
    record ends with a newline, so bytes after the last newline are a write cut
    short by a kill: they are dropped from the file and that record is computed
    and written again. A malformed complete line raises.

    Parameters
    ----------
    path : str
        Results file (created with its folder when missing).
    key_fields : sequence of str
        Record fields that identify one unit of work.
    """

    def __init__(self, path, key_fields):
        self.path = str(path)
        self.key_fields = tuple(key_fields)
        self.keys = set()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.exists(self.path):
            self._load()
        self._fh = open(self.path, "a", encoding="utf-8")

    def _load(self):
        with open(self.path, "rb") as fh:
            data = fh.read()
        *lines, tail = data.split(b"\n")  # ``tail``: bytes after the last newline
        for lineno, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
                self.keys.add(record_key(self.key_fields, record))
            except (ValueError, KeyError) as err:
                raise ValueError(f"{self.path}:{lineno}: malformed record ({err})") from None
        if tail:  # a write cut short: drop it, the record is recomputed
            with open(self.path, "r+b") as fh:
                fh.truncate(len(data) - len(tail))

    def done(self, record_or_key):
        """Whether a record with this key (a record dict or a tuple of key values) is already written."""
        return record_key(self.key_fields, record_or_key) in self.keys

    def write(self, record):
        """Append ``record`` as one line, flushed and fsynced.

        Raises
        ------
        ValueError
            If a record with the same key was already written.
        """
        key = record_key(self.key_fields, record)
        if key in self.keys:
            raise ValueError(f"{self.path}: duplicate record for key {key}")
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.keys.add(key)

    def __len__(self):
        return len(self.keys)

    def close(self):
        self._fh.close()


def read_jsonl(path):
    """Yield the records of a JSONL file (blank lines skipped).

    Raises
    ------
    ValueError
        ``path:line`` of the first line that is not a JSON object.
    """
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            yield record


def read_records(path, fields):
    """Records of a JSONL data file, each checked to carry ``fields`` (ValueError naming the record)."""
    records = []
    for i, record in enumerate(read_jsonl(path)):
        missing = [f for f in fields if f not in record]
        if missing:
            raise ValueError(f"{path}: record {i + 1} lacks fields {missing}")
        records.append(record)
    return records
