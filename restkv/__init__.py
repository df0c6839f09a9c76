"""restkv: KV-cache eviction at prefill (ReST-KV and baselines) for transformers models."""

from .cache import memory_report
from .config import METHODS, PRESETS, CompressionConfig
from .integration import (
    configure,
    install,
    kept_positions,
    replace_gemma,
    replace_gemma2,
    replace_gemma3,
    replace_llama,
    replace_mistral,
    replace_qwen2,
)
from .sweep import prefill_caches as sweep_caches
from .sweep import sweep

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "PRESETS",
    "CompressionConfig",
    "configure",
    "install",
    "kept_positions",
    "memory_report",
    "replace_gemma",
    "replace_gemma2",
    "replace_gemma3",
    "replace_llama",
    "replace_mistral",
    "replace_qwen2",
    "sweep",
    "sweep_caches",
]
