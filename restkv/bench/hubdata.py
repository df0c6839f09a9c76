"""Loading a benchmark's data set with ``datasets``: from where the user has it (a file, a folder, a hub
snapshot) or from the hub.

A data set is a :class:`Source`: its name, the hub id (and config and split) of its reference copy, and the
file stems it may have in a local folder. :func:`load_rows` looks in ``--data_dir`` first:

1. ``<data_dir>/<stem>.jsonl`` / ``.json`` / ``.parquet`` for each stem (one file per data set);
2. ``<data_dir>/<name>/``: a folder ``datasets`` reads (a hub snapshot of that data set, or its split files);
3. ``<data_dir>`` itself when its ``README.md`` declares the data set's config (a snapshot of a hub
   repository with one config per task, e.g. ``hf download microsoft/SCBench --repo-type dataset
   --local-dir data/scbench``); ``--data_dir`` may also be the data file itself;

and otherwise loads the hub id. When neither is reachable it raises one line naming ``--data_dir``, where it
looked and the command that downloads the data.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from ..lazy import require

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Source:
    """Where one data set comes from.

    Parameters
    ----------
    name : str
        Its name (a results folder, a sub-folder of ``--data_dir``).
    hub : str
        The hub id of the reference copy.
    config : str, optional
        The hub config (e.g. ``main`` of ``openai/gsm8k``).
    split : str
        The split to read (a copy with one split only gives that one).
    stems : tuple of str
        File stems looked for in ``--data_dir`` (default: ``name``).
    own_folder : bool
        Whether a hub snapshot of it goes in ``<data_dir>/<name>/`` (one repository per data set) rather than
        in ``<data_dir>`` itself (one repository for all: its files, or one config per task).
    """

    name: str
    hub: str
    config: str | None = None
    split: str = "test"
    stems: tuple = ()
    own_folder: bool = True

    def where(self) -> str:
        """``hub id[, config], split`` for ``--help``."""
        config = f" (config {self.config})" if self.config else ""
        return f"{self.hub}{config}, split {self.split}"


def add_data_dir(parser, holds: str, default_dir: str, hub: str):
    """The ``--data_dir`` flag of a runner whose data :func:`load_rows` reads: ``holds`` says what it holds, and
    ``--help`` names the default folder and the hub copy (``hub``)."""
    action = parser.add_argument(
        "--data_dir",
        default=None,
        help=f"{holds} (default: {default_dir} when it exists); what is not there is loaded from the hub with "
        f"`datasets` ({hub})",
    )
    action.example = default_dir
    return action


def _configs(folder: str) -> set:
    """The config names a hub snapshot's ``README.md`` declares (empty without one)."""
    path = os.path.join(folder, "README.md")
    if not os.path.isfile(path):
        return set()
    with open(path, encoding="utf-8") as fh:
        return set(re.findall(r"config_name:\s*([\w.\-]+)", fh.read()))


def locate(source: Source, data_dir: str | None):
    """``(what load_dataset reads, its config)`` in ``data_dir`` for ``source``, or ``(None, None)`` when it is
    not there (the hub then)."""
    if not data_dir:
        return None, None
    if os.path.isfile(data_dir):
        return data_dir, None
    for stem in source.stems or (source.name,):
        for ext in FORMATS:
            path = os.path.join(data_dir, stem + ext)
            if os.path.isfile(path):
                return path, None
    folder = os.path.join(data_dir, source.name)
    if os.path.isdir(folder):
        return folder, source.config if source.config in _configs(folder) else None
    if source.config is not None and source.config in _configs(data_dir):
        return data_dir, source.config
    return None, None


def _load(path: str, config: str | None):
    from datasets import load_dataset

    ext = os.path.splitext(path)[1]
    if os.path.isfile(path):
        return load_dataset(FORMATS.get(ext, "json"), data_files=path)
    return load_dataset(path, config) if config else load_dataset(path)


def _split(data, source: Source, where: str):
    """The split of ``source`` in a loaded ``DatasetDict`` (its only split when it has one)."""
    names = list(data)
    if source.split in data:
        return data[source.split]
    if len(names) == 1:
        return data[names[0]]
    raise ValueError(f"{where}: no split {source.split!r} (it has {', '.join(names)})")


def _short(err: Exception) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}"


def _load_hub(source: Source, offline):
    """``source``'s hub copy through ``datasets``; with ``offline`` (the hub unreachable) its cached copy
    only, at once, instead of the retries of each request."""
    import datasets

    args = (source.hub, source.config) if source.config else (source.hub,)
    if not offline:
        return datasets.load_dataset(*args)
    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(*args)
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def load_rows(source: Source, data_dir: str | None, default_dir: str = "data", flag: str = "--data_dir") -> list:
    """The records of ``source`` as dicts: from ``data_dir`` (module docstring) or from the hub.

    ``default_dir`` is the folder the download command in the error names when ``data_dir`` is None.

    Raises
    ------
    FileNotFoundError
        ``data_dir`` is given but does not exist, or the data set is neither there nor on the hub (one line
        naming ``flag``, where it looked and how to download it).
    ValueError
        A local copy ``datasets`` cannot read (naming the path), or one without the split.
    """
    require("datasets", needed_by=f"loading {source.name}")
    if data_dir and not os.path.exists(data_dir):
        raise FileNotFoundError(f"{flag}: {data_dir} does not exist")
    path, config = locate(source, data_dir)
    if path is not None:
        try:
            data = _load(path, config)
        except Exception as err:  # datasets' own errors: one line naming the file
            raise ValueError(f"{flag}: {path} is not a data set datasets can read ({_short(err)})") from None
        return [dict(r) for r in _split(data, source, path)]
    from .models import hub_unreachable

    offline = hub_unreachable()
    try:
        data = _load_hub(source, offline)
    except Exception as err:  # offline, unknown id, gated: one line with what to do
        if offline:
            err = f"the hub is unreachable ({offline}) and datasets' cache has no copy"
        folder = data_dir or default_dir
        snapshot = os.path.join(folder, source.name) if source.own_folder else folder
        looked = (
            f"{data_dir} has no {'/'.join(source.stems or (source.name,))}.jsonl/.json/.parquet or "
            f"{source.name}/ folder" if data_dir else "no --data_dir given"
        )
        raise FileNotFoundError(
            f"{flag}: {source.name} not found ({looked}) and the hub copy {source.hub} could not be loaded "
            f"({err if offline else _short(err)}); download it with: hf download {source.hub} --repo-type dataset "
            f"--local-dir {snapshot}"
        ) from None
    print(f"{source.name}: not in {data_dir or '(no --data_dir)'}, loaded {source.hub} from the hub",
          file=sys.stderr)
    return [dict(r) for r in _split(data, source, source.hub)]


def load_records(source: Source, data_dir, default_dir: str, limit=None, convert=None) -> list:
    """:func:`load_rows`, then ``convert(rows, where) -> records`` (a runner's checks and form; ``where`` names
    the copy in its errors), then the first ``limit`` records when given."""
    rows = load_rows(source, data_dir, default_dir)
    records = convert(rows, data_dir or source.hub) if convert else rows
    return records[:limit] if limit else records
