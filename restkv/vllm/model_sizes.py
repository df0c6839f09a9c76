"""A model's sizes as the plugin's memory estimate reads them (``restkv.vllm.memory``): its attention
layers, query and KV heads (one tensor-parallel rank's: ``Model.per_rank``), head size, o_proj's rows and
bytes per element; a built-in model (``MODELS``) or a folder's ``config.json`` (``model_of``). No vLLM
import here.

A hybrid model (Gemma 2 and 3, gpt-oss) has ``sliding`` sliding-window layers of ``window`` tokens among
its ``layers``: vLLM frees their blocks out of the window, the plugin evicts the others (``evicted``, its
full-attention layers). vLLM's hybrid allocator puts ``group_layers`` layers in each KV cache group (the
fewer layers of a kind; as many as the more where those are under 1.5 times as many), every group's
blocks from one pool: a block holds ``block_size`` tokens of ``group_layers`` layers. ``cache_bytes``:
the pool's bytes per element (``kv_cache_dtype``; FP8: 1, its entries read back for scoring in float32).
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
# vLLM's ``kv_cache_dtype`` -> the pool's bytes per element (None: the model's dtype)
KV_CACHE_DTYPES = {"auto": None, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class Model:
    layers: int
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int
    hidden: int
    dtype_bytes: int
    ranks: int = 1  # tensor-parallel ranks sharing the heads (``heads``, ``kv_heads``: one rank's)
    sliding: int = 0  # of ``layers``, the sliding-window ones (vLLM's to free)
    window: int = 0  # their window, tokens
    cache_bytes: int | None = None  # the KV pool's bytes per element; None: ``dtype_bytes``

    @property
    def evicted(self) -> int:
        """The layers the plugin evicts: the full-attention ones."""
        return self.layers - self.sliding

    @property
    def pool_bytes(self) -> int:
        """Bytes per element of the KV pool."""
        return self.cache_bytes or self.dtype_bytes

    @property
    def read_bytes(self) -> int:
        """Bytes per element of the entries an eviction reads back: an FP8 pool's dequantized, float32."""
        return 4 if self.pool_bytes == 1 else self.dtype_bytes

    @property
    def group_layers(self) -> int:
        """Layers per KV cache group (vLLM's ``_get_kv_cache_groups_uniform_page_size``): all of them
        in one group where they are of one kind."""
        kinds = [n for n in (self.evicted, self.sliding) if n]
        least, most = min(kinds), max(kinds)
        return most if most < 1.5 * least else least

    def groups(self) -> tuple[int, int]:
        """KV cache groups of full attention and of sliding windows, each of ``group_layers`` layers
        at most."""
        g = self.group_layers
        return -(-self.evicted // g), -(-self.sliding // g)

    def block_bytes(self, block_size: int) -> int:
        """One block of the pool: ``block_size`` tokens of ``group_layers`` layers."""
        return block_size * self.group_layers * self.kv_bytes(1, self.pool_bytes)

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


def layer_kinds(raw: dict) -> tuple[list[bool], int]:
    """A config's layers, whether each slides, and their window (``config.json``'s, or its text
    config's): ``layer_types`` ("sliding_attention" / "full_attention"), else a ``sliding_window`` with
    Gemma's pattern (every ``sliding_window_pattern``-th layer full; Gemma 2's every other one), else a
    ``sliding_window`` on every layer (Mistral) unless ``use_sliding_window`` is false (Qwen2)."""
    window, kinds = raw.get("sliding_window") or 0, raw.get("layer_types")
    layers = raw.get("num_hidden_layers") or len(kinds or ())
    if kinds is not None:
        if len(kinds) != layers:
            raise ValueError(f"--model: config.json's layer_types has {len(kinds)} layers, not {layers}")
        slides = [kind == "sliding_attention" for kind in kinds]
    elif not window or raw.get("use_sliding_window") is False:
        slides = [False] * layers
    else:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
        pattern = pattern or (2 if raw.get("model_type") == "gemma2" else 0)
        slides = [not pattern or (i + 1) % pattern != 0 for i in range(layers)]
    if any(slides) and not window:
        raise ValueError("--model: config.json has sliding_attention layers and no sliding_window")
    return slides, window if any(slides) else 0


def model_of(name_or_folder: str, dtype: str | None = None, kv_cache_dtype: str = "auto") -> Model:
    """A built-in model (``MODELS``) or a folder's ``config.json``; ``dtype`` overrides its dtype,
    ``kv_cache_dtype`` (vLLM's) sets the pool's element."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype: {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
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
        slides, window = layer_kinds(raw)
        c = dict(
            sliding=sum(slides),
            window=window,
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
    return Model(**c, dtype_bytes=_BYTES[dtype], cache_bytes=KV_CACHE_DTYPES[kv_cache_dtype])
