"""What differs between the transformers versions restkv supports (see requirements.txt)."""

from __future__ import annotations

import inspect


def cache_argument(model) -> str:
    """The keyword a model's (or decoder's) forward takes its cache by: ``cache`` in recent transformers,
    ``past_key_values`` before (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
