"""Constants computed from a model once (on the packaged essays) and kept in memory and on disk.

Q-Filters' filters have their own module (``restkv.integration.qfilters``); the query statistics of
``expected_attention_stats`` and DuoAttention's head scores go through ``computed_once``: from
memory, else from the disk cache (``qfilters.cache_path``, for a model loaded from a checkpoint),
else computed and written there.
"""

from __future__ import annotations

import os
import sys
import weakref

from transformers import AutoTokenizer

from ..lazy import torch
from .qfilters import cache_path

# model -> {(folder, version, recipe): value}
_MEMORY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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


def computed_once(model, folder: str, version: str, recipe: tuple, compute, what: str):
    """``compute()`` (a tensor or a dict of tensors) once per model and ``recipe``: from memory,
    the disk cache of a model with a checkpoint, or computed (then written to that cache)."""
    known = _MEMORY.setdefault(model, {})
    key = (folder, version, recipe)
    if key in known:
        return known[key]
    # a model without a checkpoint: memory only
    named = bool(getattr(model.config, "_name_or_path", ""))
    cached = cache_path(model, recipe, folder, version)
    if named and cached.is_file():
        value = torch.load(cached, map_location="cpu", weights_only=True)
    else:
        source = getattr(model.config, "_name_or_path", "") or "the model"
        where = cached if named else "memory"
        print(f"{what} of {source}: computing them once on the essays (into {where})",
              file=sys.stderr)
        value = compute()
        if named:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.tmp")
            torch.save(value, partial)
            os.replace(partial, cached)
    known[key] = value
    return value
