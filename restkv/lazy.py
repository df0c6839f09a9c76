"""Modules imported on first use.

The knob declarations (``config``, ``methods/``, ``budgets``, ``merge``) are read by the runners to
build their command lines before any model work; the modules that declare them use ``torch``
through these stand-ins, so reading a declaration imports no torch.
"""

from __future__ import annotations

import importlib


class LazyModule:
    """Stands for the module ``name``; the first attribute read imports it."""

    def __init__(self, name: str):
        self._name = name
        self._module = None

    def __getattr__(self, attr):
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name}>"


torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
