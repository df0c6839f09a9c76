"""A model's sizes as the plugin's memory estimate reads them (``restkv.vllm.memory``): its attention
layers, query and KV heads (one tensor-parallel rank's: ``Model.per_rank``), head size, o_proj's rows and
bytes per element; a built-in model (``MODELS``) or a folder's ``config.json`` (``model_of``). No vLLM
import here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

MODELS = {  # per the models' config.json
    "smollm2-135m": dict(layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, dtype="bfloat16"),
    "llama-3.1-8b": dict(layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, dtype="bfloat16"),
}
_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class Model:
    layers: int
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int
    hidden: int
    dtype_bytes: int
    ranks: int = 1  # tensor-parallel ranks sharing the heads (``heads``, ``kv_heads``: one rank's)

    def per_rank(self, tensor_parallel: int) -> Model:
        """One rank's heads (KV heads replicated when fewer than the ranks, as vLLM does)."""
        return replace(
            self,
            heads=self.heads // tensor_parallel,
            kv_heads=max(1, self.kv_heads // tensor_parallel),
            ranks=tensor_parallel,
        )

    def kv_bytes(self, entries: int, element: int | None = None) -> int:
        """K+V of ``entries`` entries of one layer."""
        return 2 * entries * self.kv_heads * self.head_dim * (element or self.dtype_bytes)


def model_of(name_or_folder: str, dtype: str | None = None) -> Model:
    """A built-in model (``MODELS``) or a folder's ``config.json``; ``dtype`` overrides its dtype."""
    if name_or_folder in MODELS:
        c = dict(MODELS[name_or_folder])
    else:
        path = os.path.join(name_or_folder, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--model: {name_or_folder!r} is neither {' nor '.join(MODELS)} nor a folder with a config.json")
        with open(path) as f:
            raw = json.load(f)
        raw = raw.get("text_config", raw)
        heads = raw["num_attention_heads"]
        c = dict(
            layers=raw["num_hidden_layers"],
            heads=heads,
            kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            hidden=raw["hidden_size"],
            dtype=raw.get("torch_dtype") or raw.get("dtype") or "float32",
        )
    dtype = dtype or c.pop("dtype")
    c.pop("dtype", None)
    if dtype not in _BYTES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(_BYTES)}")
    return Model(**c, dtype_bytes=_BYTES[dtype])
