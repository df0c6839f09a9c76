"""Scores in float32 whatever the caller's numerics: ``float32_scoring()`` around an eviction step.

Inside it the caller's ``torch.autocast`` is off (a bf16 autocast would run the scores' float32
matmuls in bf16), float32 matmuls and convolutions (the pooling conv1d) may not use TF32
(``allow_tf32``, the float32 matmul precision), and the default dtype is float32 (score buffers made
without a dtype). Every setting is restored on exit, also on an error. The eviction steps
(``restkv.eviction.step.evict_layer``, the shrink of decoding-time eviction, the deferred
selections) enter it once; no scorer needs to.
"""

from __future__ import annotations

import contextlib

from ..lazy import torch


@contextlib.contextmanager
def float32_scoring(device_type: str = "cpu"):
    """The block computes in float32: no autocast on ``device_type``, no TF32, float32 defaults."""
    matmul = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn
    precision = torch.get_float32_matmul_precision()
    dtype = torch.get_default_dtype()
    saved = (matmul.allow_tf32, cudnn.allow_tf32, precision, dtype)
    try:
        matmul.allow_tf32 = False
        cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        torch.set_default_dtype(torch.float32)
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        matmul.allow_tf32 = saved[0]
        cudnn.allow_tf32 = saved[1]
        torch.set_float32_matmul_precision(saved[2])
        torch.set_default_dtype(saved[3])
