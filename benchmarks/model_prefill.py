"""Peak extra memory of a method's prefill over the full cache's, on a random model of a few layers.

For the selections that cannot be measured on one layer (``scaling.py``): those finished after every
layer's prefill (passes such as KVzip's, a cross-layer budget). The model is a randomly initialised
``LlamaForCausalLM`` of Llama-3-8B's head geometry (``heads`` query / KV heads, head_dim 128, hidden
size heads x 128, RoPE theta 500000) with ``layers`` layers and a small MLP (``INTERMEDIATE`` wide),
sdpa, the vocabulary of SmolLM2's tokenizer (the repeat passes' template is written with it). The
prompt is random token ids; the prefill is one forward, unchunked, as is the full cache's.

Peak extra memory (``devices.PeakMemory``: on CPU the resident set, run with a fixed glibc mmap
threshold) of ``model(ids)`` with the method configured, minus that of the same prefill with the full
cache: what the selection holds on top of the full cache it starts from (every layer's scores, the
passes and their activations, KVgrad's autograd graph). A negative extra means the method's prefill
peaks lower than the full cache's. Every config first runs a warm-up prefill of ``WARMUP`` tokens.

A method without its own per-model data gets it here: a random HeadKV table (``head_importance``)
and random Fast KVzip gates (``fastkvzip_file``), written to a temporary folder.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

from compress_step import D, parse_method
from devices import PeakMemory, random_llama

INTERMEDIATE = 1024
VOCAB = 49152  # SmolLM2's tokenizer
WARMUP = 512


def random_model(heads: tuple[int, int], layers: int, dtype: str, device: str):
    """A random Llama of ``heads`` (query, KV) heads of 128 dimensions and ``layers`` layers, sdpa."""
    import torch
    from transformers import LlamaConfig

    hq, hkv = heads
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hq * D,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=D,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return random_llama(config, getattr(torch, dtype), device)


def method_files(model, folder: Path, tokenizer: str) -> dict:
    """Knob values of the per-model data a method may read: the repeat template's tokenizer, a random
    HeadKV table (the authors' format) and random Fast KVzip gates (the authors' format)."""
    import torch

    from restkv.integration import trained

    config = model.config
    g = torch.Generator().manual_seed(0)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    importance = torch.rand(layers, heads, generator=g)
    table = {f"{l}-{h}": [float(importance[l, h])] for l in range(layers) for h in range(heads)}
    table_path = folder / "head_importance.json"
    table_path.write_text(json.dumps(table))
    groups = heads // config.num_key_value_heads
    gates = [
        trained.new_gate(config.hidden_size, config.num_key_value_heads, groups, g)
        for _ in range(layers)
    ]
    gates_path = folder / "gates.pt"
    torch.save(trained.to_file("fastkvzip", gates), gates_path)
    return {  # the files first: a method reads its tokenizer only when it trains what they hold
        "head_importance": str(table_path),
        "fastkvzip_file": str(gates_path),
        "tokenizer": tokenizer,
    }


def knobs_of(spec: str, budget: int, window: int, files: dict) -> dict:
    """``configure`` knobs of ``spec`` with the budget, the window and each of ``files`` it takes."""
    from restkv.config import CompressionConfig

    knobs = {"max_capacity_prompt": budget, "window_size": window, **parse_method(spec)}
    if knobs["method"] == "fullkv":
        return {"method": "fullkv"}
    for key, value in files.items():
        try:
            CompressionConfig.from_kwargs(**knobs, **{key: value})
        except ValueError:
            continue  # not a knob of this method
        knobs[key] = value
    return knobs


def prefill(model, ids, knobs: dict, memory: bool) -> dict:
    """One prefill of ``ids`` [1, L] with ``knobs`` -> {"peak": extra bytes or None, "time": s}."""
    import torch

    import restkv

    restkv.configure(model, **knobs)
    gc.collect()
    with torch.no_grad(), PeakMemory(ids.device) as mem:
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    del out
    gc.collect()
    return {"peak": mem.extra if memory else None, "time": seconds}


def measure(
    specs: list[str],
    length: int,
    heads: tuple[int, int],
    layers: int,
    budget: int,
    window: int,
    dtype: str,
    device: str,
    tokenizer: str,
) -> tuple[list[dict], dict]:
    """Per spec {"peak": extra over the full cache's prefill, "time"}, and the full cache's
    {"peak", "time", "layer_kv", "model_kv"} (bytes of one layer's and of every layer's K+V)."""
    import torch

    model = random_model(heads, layers, dtype, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (1, length), generator=g).to(device)
    with tempfile.TemporaryDirectory() as folder:
        files = method_files(model, Path(folder), tokenizer)
        configs = [knobs_of(s, budget, window, files) for s in ["fullkv", *specs]]
        for knobs in configs:
            prefill(model, ids[:, :WARMUP], knobs, memory=False)
        full, *rest = [prefill(model, ids, knobs, memory=True) for knobs in configs]
    layer_kv = 2 * heads[1] * length * D * getattr(torch, dtype).itemsize
    rows = [{"peak": r["peak"] - full["peak"], "time": r["time"]} for r in rest]
    return rows, {**full, "layer_kv": layer_kv, "model_kv": layers * layer_kv}
