"""The runners' checks before any work: shared flags, the results folder, the device and backend; a
failed check ends the program in one line (:func:`startup`)."""

import sys


def startup(parser, prepare, args):
    """``prepare(args)``: a run's checks before any work. A ``ValueError`` or ``FileNotFoundError`` they raise
    (bad input, named by its flag or field) or a missing extra (``restkv.lazy.MissingExtra``) ends the program
    as ``parser.error`` does (one line, exit code 2); any other error keeps its traceback."""
    from restkv.lazy import MissingExtra

    try:
        return prepare(args)
    except (ValueError, FileNotFoundError, MissingExtra) as err:
        parser.error(str(err))


def results_dir(path: str) -> None:
    """Raise ``FileNotFoundError`` (naming ``--results_dir``) unless ``path`` is a folder with ``.jsonl`` results."""
    from pathlib import Path

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"--results_dir: {path} is not a folder")
    if next(root.rglob("*.jsonl"), None) is None:
        raise FileNotFoundError(f"--results_dir: no .jsonl predictions under {path}")


# How each benchmark's results are tabulated ({path}: its results folder; needles: its results file).
TABULATE = {
    "needle": "python -m restkv.bench.needle.report {path}",
    "ruler": "python eval_ruler.py --results_dir {path}",
    "longbench": "python eval.py --results_dir {path}",
    "longbench_e": "python eval.py --e --results_dir {path}",
    "infinite_bench": "python eval_infinite.py --results_dir {path}",
    "math": "python eval_math.py --results_dir {path}",
    "longbench_v2": "python eval_longbench_v2.py --results_dir {path}",
    "scbench": "python eval_scbench.py --results_dir {path}",
}


def other_results(root, wanted):
    """``"; <folder> holds needle results: tabulate them with ..."`` when runs under ``root`` (their
    ``run_meta.json``) are of another benchmark than ``wanted``, else ``""``."""
    import json
    from pathlib import Path

    hints = []
    for meta in sorted(Path(root).rglob("run_meta.json")):
        try:
            benchmark = json.loads(meta.read_text(encoding="utf-8")).get("benchmark")
        except (OSError, ValueError):
            continue
        if benchmark in TABULATE and benchmark != wanted:
            where = meta.parent / "results.jsonl" if benchmark == "needle" else meta.parent
            hints.append(
                f"{meta.parent} holds {benchmark} results: tabulate them with "
                + TABULATE[benchmark].format(path=where)
            )
    return "; " + "; ".join(hints) if hints else ""


def check_common(args):
    """The checks of the shared flags that argparse does not make (``ValueError`` naming the flag)."""
    for flag in ("batch_size", "max_length", "max_new_tokens", "max_num_examples", "threads"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    if getattr(args, "use_cache", True) is False:
        raise ValueError(
            "--use_cache: restkv always decodes on the KV cache (the one it evicts); "
            "only --use_cache (true) is accepted"
        )
    if getattr(args, "save_dir", None):
        check_save_dir(args)


def check_save_dir(args):
    """Raise ``ValueError`` naming ``--save_dir`` when the run's folder (``<save_dir>/<model>``, or
    ``<model_version>``) cannot be made: it, ``--save_dir`` or a folder above is a file, or the
    nearest existing folder is not writable."""
    import os
    from pathlib import Path

    from ..models import model_name

    given = Path(os.path.abspath(args.save_dir))
    name = getattr(args, "model_version", None) or model_name(args.model_path)
    out = given / name
    for folder in (out, *out.parents):
        if not folder.exists():
            continue
        if folder == out and not folder.is_dir():
            raise ValueError(f"--save_dir: {out} (the run's folder) is a file; give another one")
        if folder == given and not folder.is_dir():
            raise ValueError(f"--save_dir: {args.save_dir} is a file, not a folder")
        if not folder.is_dir():
            raise ValueError(f"--save_dir: {args.save_dir} lies under {folder}, a file")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"--save_dir: {args.save_dir}: {folder} is not writable")
        return


# The package each flash-attention backend needs.
FLASH_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn 3"),
}


def check_backend(args, file=None):
    """Resolve ``--device auto``; refuse a device or backend this machine cannot run, before any work.

    Raises
    ------
    ValueError
        One line naming the flag and what to do instead: ``--device cuda`` without a CUDA device,
        ``--attn_implementation flash_attention_2`` without flash-attn (the ``.[flash]`` extra) or off
        CUDA.
    """
    import importlib.util
    import os

    from restkv.lazy import torch

    device = str(args.device)
    backend = args.attn_implementation
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            print("--device auto: no CUDA device here, running on CPU", file=file or sys.stderr)
        args.device = device
    if device.startswith("cuda") and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ValueError(
            f"--device {device}: no CUDA device here{shown}; use --device cpu (or auto)"
        )
    if backend in FLASH_PACKAGES:
        module, package = FLASH_PACKAGES[backend]
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"--attn_implementation {backend}: {package} is not installed; install "
                "restkv's flash extra (pip install -e '.[flash]', on a CUDA machine) or use "
                "--attn_implementation sdpa"
            )
        on_cuda = device.startswith("cuda") or getattr(args, "device_map", None)
        if not on_cuda:
            raise ValueError(
                f"--attn_implementation {backend} runs on CUDA only "
                f"(--device {device}); "
                "add --device cuda, or use --attn_implementation sdpa"
            )
