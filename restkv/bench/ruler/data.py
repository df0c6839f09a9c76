"""Read RULER data folders: ``<dir>/<task>/validation.jsonl`` (ours or RULER's own scripts)."""

from pathlib import Path

from restkv.bench.results import read_jsonl
from restkv.bench.ruler.tasks import task_order

REQUIRED = ("index", "input", "outputs")
GENERATE = (
    "generate the data with: bash scripts/ruler/generate.sh (MODEL=... LENGTHS=\"4096 8192\"), or "
    "python -m restkv.bench.ruler.generate --model_path MODEL --lengths 4096 --out_dir data/ruler/MODEL "
    "(then --data_dir data/ruler/MODEL/4096)"
)


def find_tasks(data_dir, subset="validation"):
    """Task names of a data folder (sub-folders holding ``<subset>.jsonl``), in RULER's order."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"--data_dir: {data_dir} is not a folder; {GENERATE}")
    tasks = [p.parent.name for p in data_dir.glob(f"*/{subset}.jsonl")]
    if not tasks:
        raise FileNotFoundError(
            f"--data_dir: no <task>/{subset}.jsonl under {data_dir}; {GENERATE}"
        )
    return task_order(tasks)


def load_task(path, context_length=None):
    """Records of one task file, checked before any work.

    Parameters
    ----------
    path : str or Path
        ``<task>/validation.jsonl``.
    context_length : int, optional
        Requested length for files without ``max_seq_length`` (RULER's own files).

    Returns
    -------
    list of dict
        Each with ``answer_prefix`` (empty when absent) and ``max_seq_length``.

    Raises
    ------
    ValueError
        Naming the file and record number of a record with a missing or malformed field.
    """
    records = []
    for lineno, rec in enumerate(read_jsonl(path), 1):
        where = f"{path} record {lineno}"
        missing = [f for f in REQUIRED if f not in rec]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        outputs = rec["outputs"]
        if not (isinstance(outputs, list) and outputs and all(isinstance(o, str) for o in outputs)):
            raise ValueError(f"{where}: 'outputs' must be a non-empty list of strings")
        if not isinstance(rec["input"], str):
            raise ValueError(f"{where}: 'input' must be a string")
        length = rec.get("max_seq_length", context_length)
        if length is None:
            raise ValueError(
                f"{where}: no 'max_seq_length'; pass --context_length for RULER's own files"
            )
        records.append(
            {**rec, "answer_prefix": rec.get("answer_prefix", ""), "max_seq_length": int(length)}
        )
    if not records:
        raise ValueError(f"{path}: no records")
    return records
