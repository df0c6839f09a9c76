"""Run metadata: ``run_meta.json`` with versions, config, git commit and command line."""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import restkv  # noqa: F401  (so its version is found when not installed as a distribution)

from .grid import check_same_configs
from .results import atomic_write


def _version(dist, module=None):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(module or dist), "__version__", None)


def git_sha(path=None):
    """HEAD commit of the repository holding ``path`` (default: this package), or None."""
    where = path or os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def write_metadata(save_dir, args, extra=None):
    """Write ``save_dir/run_meta.json``: versions, full config, git sha, command line, ``extra``.

    When ``extra`` has ``configs`` (``configs_meta``) and the folder already holds a run, every label both
    runs share must resolve to the same knobs, the question mode (``query_agnostic``; absent: False) must be
    the same, and so must the ``settings`` (prompt settings of runs whose files are per label) when ``extra``
    has them (else ValueError, before any work); the earlier labels stay listed. Every run is kept in
    ``runs`` (time, command line, settings, labels), the latest one also at the top level.

    Returns the path written.
    """
    config = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    path = os.path.join(save_dir, "run_meta.json")
    extra = dict(extra or {})
    before = check_rerun(save_dir, extra)
    if "configs" in extra and before:
        extra["configs"] = {**(before.get("configs") or {}), **extra["configs"]}  # earlier labels stay on record
    meta = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "restkv": _version("restkv"),
        },
        "git_sha": git_sha(),
        "platform": platform.platform(),
        "config": config,
        **extra,
    }
    meta["runs"] = _runs(before) + [_run_summary(meta)]
    atomic_write(path, json.dumps(meta, indent=2, default=str))
    return path


def check_rerun(save_dir, extra):
    """The checks :func:`write_metadata` makes of a run into a folder that holds one (``ValueError`` naming
    ``save_dir/run_meta.json`` and what differs), made by each runner before its model loads too; returns the
    earlier ``run_meta.json`` (``{}``: none). Results without a readable ``run_meta.json`` (moved away,
    corrupted) are refused too: nothing says what they were made with, and a rerun would add records of its
    own settings to theirs.

    ``extra`` holds this run's ``configs`` (``configs_meta``), and optionally its ``settings`` and
    ``query_agnostic``.
    """
    path = os.path.join(save_dir, "run_meta.json")
    if not os.path.exists(path):
        held = results_held(save_dir) if "configs" in extra else None
        if held:
            raise ValueError(
                f"{save_dir} holds results ({held}) but no run_meta.json: what they were made with is unknown, "
                "and this run would add to them; put their run_meta.json back or use another --save_dir"
            )
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            before = json.load(fh)
    except ValueError as err:
        raise ValueError(
            f"{path}: not JSON ({err}); what the results there were made with is unknown: use another --save_dir"
        ) from None
    if "configs" in extra and before:
        previous = before.get("configs") or {}
        check_same_configs(path, previous, extra["configs"])
        check_same_settings(path, before, extra, set(previous) & set(extra["configs"]))
        then, now = (
            bool(before.get("query_agnostic", False)),
            bool(extra.get("query_agnostic", False)),
        )
        if then != now:
            raise ValueError(
                f"{path}: the results there were made {'with' if then else 'without'} --query_agnostic; "
                "rerunning into this folder would mix the two modes: use another --save_dir"
            )
    return before


def results_held(folder):
    """The first results file (``*.jsonl``) under ``folder``, relative to it, or None."""
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".jsonl"):
                return os.path.relpath(os.path.join(root, name), folder)
    return None


def run_folder(args):
    """The folder of a run's results and ``run_meta.json``: ``<save_dir>/<model>`` (``<save_dir>/<model_version>``
    with the needle runner's ``--model_version``)."""
    from .models import model_name

    return os.path.join(args.save_dir, getattr(args, "model_version", None) or model_name(args.model_path))


def check_args_rerun(args, configs, settings=None):
    """:func:`check_rerun` of the run of ``args`` with ``configs`` (``(label, kwargs)``) and its prompt
    ``settings``, before any model work."""
    from .grid import configs_meta

    extra = {"configs": configs_meta(configs), "query_agnostic": bool(getattr(args, "query_agnostic", False))}
    check_rerun(run_folder(args), {**extra, **({"settings": settings} if settings is not None else {})})


_SUMMARY = ("time", "argv", "git_sha", "versions", "settings", "query_agnostic")


def _run_summary(meta):
    """What ``runs`` keeps of one run: its time, command line, versions, settings and labels."""
    labels = meta.get("labels")
    return {
        **{k: meta[k] for k in _SUMMARY if k in meta},
        "labels": list(labels) if labels is not None else list(meta.get("configs") or {}),
    }


def _runs(before):
    """The runs of an earlier ``run_meta.json`` (one written before ``runs`` existed: itself)."""
    if not before:
        return []
    return list(before.get("runs") or [_run_summary(before)])


def check_same_settings(path, before, extra, shared):
    """Raise if labels ``shared`` by the run in ``path`` and this one were made with other prompt ``settings``
    (their records would be resumed into, mixing the two)."""
    then = before.get("settings")
    now = extra.get("settings")
    if not shared or then is None or now is None:
        return
    changed = {k: (then.get(k), v) for k, v in now.items() if then.get(k) != v}
    if changed:
        what = ", ".join(f"{k}={a!r} then, {b!r} now" for k, (a, b) in sorted(changed.items()))
        raise ValueError(
            f"{path}: results for {sorted(shared)[0]} were made with other settings ({what}); "
            "rerunning into this folder would mix them: use another --save_dir"
        )
