"""The plugin's start-up line: what it does in this worker, one line through vLLM's logger once the
worker's model and KV cache exist (``hooks.covered``), e.g. ``restkv: snapkv
max_capacity_prompt=64 window_size=8 decode_interval=0; backend CPU_ATTN; runner V1`` or
``restkv: off (RESTKV_VLLM and additional_config['restkv'] unset)``. No vLLM import here.
"""

from __future__ import annotations

import logging

from ..config import CompressionConfig

logger = logging.getLogger("vllm.restkv")  # under vLLM's logger: its handler and level
OFF = "restkv: off (RESTKV_VLLM and additional_config['restkv'] unset)"
SHOWN = ("max_capacity_prompt", "window_size", "decode_interval")
V2 = "vllm.v1.worker.gpu.model_runner"  # the V2 model runner's module (``hooks.table._V2``)


def knobs(cfg: CompressionConfig) -> str:
    """``snapkv max_capacity_prompt=64 window_size=8 decode_interval=0``, then every other knob
    whose value is not the method's default."""
    default = CompressionConfig.from_kwargs(method=cfg.method)
    rest = [k for k in cfg if k not in SHOWN and k != "method" and cfg[k] != default.get(k)]
    return " ".join([cfg.method] + [f"{k}={cfg[k]}" for k in (*SHOWN, *rest) if k in cfg])


def runner(cls: type) -> str:
    """``V2`` for vLLM's V2 model runner or a subclass of it, else ``V1``."""
    return "V2" if any(k.__module__ == V2 for k in cls.__mro__) else "V1"


def line(cfg: CompressionConfig | None, backends=(), runner_name: str = "") -> str:
    """The line for ``cfg`` (None: off), the attention ``backends`` of its layers, the runner."""
    if cfg is None:
        return OFF
    names = sorted(set(backends))
    backend = f"backend{'s' if len(names) > 1 else ''} {', '.join(names)}"
    return f"restkv: {knobs(cfg)}; {backend}; runner {runner_name}"


def log(cfg: CompressionConfig | None, backends=(), runner_cls: type | None = None) -> None:
    """Emit the line (``runner_cls``: the worker's model runner class)."""
    logger.info(line(cfg, backends, runner(runner_cls) if runner_cls else ""))
