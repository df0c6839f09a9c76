"""Clocks and memory counters of the benchmarks, for the device the model or tensors sit on.

- ``sync(device)``: ``torch.cuda.synchronize(device)`` on a CUDA device (so a clock read after it counts
  the kernels launched before), nothing on CPU.
- ``PeakMemory(device)``: the peak extra memory of a ``with`` block. On CUDA ``max_memory_allocated(device)``
  minus ``memory_allocated(device)`` before (the peak statistics of that device reset on entry); on CPU the
  process's peak resident set (VmHWM, reset through ``/proc/self/clear_refs``) minus its resident set before.
- ``device_of(model)``: the device of a model's first parameter (``cuda:1`` stays ``cuda:1``).
"""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM


def process_status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def as_device(device) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``, so that every counter reads one device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_of(model) -> torch.device:
    return as_device(next(model.parameters()).device)


def sync(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device) -> int:
    """Bytes held now: the CUDA allocator's on a CUDA device, the resident set on CPU."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return process_status("VmRSS")


class PeakMemory:
    """``with PeakMemory(device) as mem: ...`` -> ``mem.extra``, the peak extra bytes of the block, and
    ``mem.peak``, the peak bytes held (allocator or resident set) during it."""

    def __init__(self, device):
        self.device = as_device(device)
        self.extra = 0
        self.peak = 0
        self.before = 0

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        self.before = allocated(self.device)
        return self

    def __exit__(self, *exc):
        sync(self.device)
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = process_status("VmHWM")
        self.extra = self.peak - self.before


def random_llama(config, dtype: torch.dtype, device):
    """A randomly initialised ``LlamaForCausalLM`` of ``config``, built directly on ``device`` in ``dtype``
    (no float32 copy on the host first), in eval mode."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
