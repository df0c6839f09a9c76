"""The context length in a GGUF file's metadata, read from its header alone (no tensors, no numpy).

GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic ``GGUF``, version (uint32),
tensor count and metadata count (uint64), then the metadata key-value pairs, each a string key, a
uint32 value type and the value. The keys wanted (``general.architecture``, ``<arch>.context_length``)
come before the tokenizer's large arrays in the files llama.cpp writes, so reading stops early.
"""

from __future__ import annotations

import struct

# value type -> struct format of a scalar
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING = 8
_ARRAY = 9


class _Reader:
    def __init__(self, fh):
        self.fh = fh

    def unpack(self, fmt):
        size = struct.calcsize("<" + fmt)
        data = self.fh.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack("<" + fmt, data)[0]

    def string(self) -> str:
        return self.fh.read(self.unpack("Q")).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item = self.unpack("I")
            count = self.unpack("Q")
            if item in _SCALARS:  # skipped in one seek
                self.fh.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
            else:
                for _ in range(count):
                    self.value(item)
            return None
        raise ValueError(f"unknown GGUF value type {kind}")


def gguf_context_length(path) -> tuple[str, int]:
    """``(key, value)`` of ``<arch>.context_length`` in the GGUF file ``path``.

    Raises
    ------
    ValueError
        Not a GGUF file, or no context length in its metadata.
    """
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        r = _Reader(fh)
        r.unpack("I")  # version
        r.unpack("Q")  # tensor count
        pairs = r.unpack("Q")
        arch = None
        values = {}
        for _ in range(pairs):
            key = r.string()
            value = r.value(r.unpack("I"))
            if key == "general.architecture":
                arch = value
            elif key.endswith(".context_length"):
                values[key] = value
            if arch is not None and f"{arch}.context_length" in values:
                return f"{arch}.context_length", int(values[f"{arch}.context_length"])
    raise ValueError(f"{path}: no <architecture>.context_length in the GGUF metadata")
