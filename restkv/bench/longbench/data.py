"""Loading LongBench records from a local folder of the official JSONL files."""

import os

from ..results import read_records
from .tasks import FIELDS

WHERE = (
    "LongBench data: download https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip, "
    "unzip it, and put its <dataset>.jsonl (and <dataset>_e.jsonl) files in data/longbench/ or pass their "
    "folder as --data_dir"
)


def data_file(data_dir, dataset, longbench_e=False):
    """Path of ``dataset``'s file: ``<data_dir>/<dataset>.jsonl`` or ``<dataset>_e.jsonl``."""
    return os.path.join(data_dir, f"{dataset}_e.jsonl" if longbench_e else f"{dataset}.jsonl")


def load_records(data_dir, dataset, longbench_e=False, limit=None, hub=False):
    """Records of one LongBench dataset.

    Parameters
    ----------
    data_dir : str
        Folder of the official JSONL files.
    dataset : str
    longbench_e : bool
        Read the LongBench-E file.
    limit : int, optional
        Keep the first ``limit`` records.
    hub : bool
        When the file is missing, load ``THUDM/LongBench`` through ``datasets``.

    Raises
    ------
    FileNotFoundError
        The file is missing (and ``hub`` is off), with where to get the data.
    ValueError
        A malformed line (``path:line``) or a record lacking official fields.
    """
    path = data_file(data_dir, dataset, longbench_e)
    if os.path.exists(path):
        records = read_records(path, FIELDS)
    elif hub:
        from datasets import load_dataset

        name = f"{dataset}_e" if longbench_e else dataset
        records = [dict(r) for r in load_dataset("THUDM/LongBench", name, split="test")]
    else:
        raise FileNotFoundError(f"--data_dir: {path} not found. {WHERE}")
    return records[:limit] if limit else records
