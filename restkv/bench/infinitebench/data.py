"""Loading InfiniteBench records from a local folder of the released JSONL files."""

import os

from ..results import read_records

WHERE = (
    "InfiniteBench data: download <task>.jsonl from https://huggingface.co/datasets/xinrongzhang2022/InfiniteBench "
    "(e.g. scripts/download_dataset.sh of OpenBMB/InfiniteBench) into one folder and pass it as --data_dir"
)
FIELDS = ("id", "context", "input", "answer", "options")


def load_records(data_dir, task, limit=None):
    """Records of ``<data_dir>/<task>.jsonl`` (first ``limit`` only when given).

    Raises
    ------
    FileNotFoundError
        The file is missing, with where to get the data.
    ValueError
        A malformed line (``path:line``) or a record lacking released fields.
    """
    path = os.path.join(data_dir, f"{task}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--data_dir: {path} not found. {WHERE}")
    records = read_records(path, FIELDS)
    return records[:limit] if limit else records
