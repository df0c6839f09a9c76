"""End to end on a random Llama of real head shapes: prefill time, decode speed and KV bytes held.

Two tables:

1. Prefill, per method at each ``--prefill-lengths``: wall time of one forward over the prompt (with
   the eviction step of every evicted layer), its ratio to the full-cache prefill, the peak extra
   memory of the forward and the KV bytes the cache holds afterwards.
2. Decode, at each ``--decode-lengths``: ms per generated token on a full cache of L entries and on
   compressed caches of ``--budgets`` entries per KV head. Decode speed does not depend on which
   entries were kept, so these caches hold random keys and values of the exact shapes (and cost no
   prefill); the compressed ones are the ``CompressedLayer`` the eviction path produces.

Every method is warmed up on a short prompt before the first timed prefill (CUDA initialisation and
ReST-KV's W_O factorisation are not timed). Clocks are read after ``torch.cuda.synchronize`` of the model's
device, and memory is counted on that device (``cuda:1`` too). Peak extra memory: on CUDA
``max_memory_allocated(device)`` minus the memory allocated before; on CPU the
process's peak resident set (VmHWM, reset through ``/proc/self/clear_refs``) minus its resident set
before. On CPU the decode table runs first; the prefill table then runs with a fixed glibc mmap
threshold, so that buffers freed by one prefill cannot hide the next one's peak (all methods, the
full-cache one included, pay the same page faults for it).

Examples::

    python benchmarks/end_to_end.py                      # CPU, small defaults
    python benchmarks/end_to_end.py --device cuda --dtype bfloat16 --preset llama3.1-8b \\
        --prefill-lengths 32768 131072 --decode-lengths 32768 131072
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import time

import torch
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache, DynamicLayer

import restkv
from restkv.cache import CompressedLayer
from restkv.eviction.select import Kept

from devices import PeakMemory, device_of, random_llama, sync  # same folder: clocks and memory counters per device

PRESETS = {  # head shapes are Llama-3-8B's in both: 32 query heads, 8 KV heads, head_dim 128, hidden 4096
    "small": dict(num_hidden_layers=2, intermediate_size=1024, vocab_size=1024),
    "llama3.1-8b": dict(num_hidden_layers=32, intermediate_size=14336, vocab_size=128256),
}


def build_model(preset: str, layers: int | None, device: str, dtype: torch.dtype, attn: str, max_len: int):
    """A randomly initialised Llama, built directly on ``device`` in ``dtype``."""
    shape = dict(PRESETS[preset])
    if layers:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=max_len, rope_theta=500000.0, **shape)
    config._attn_implementation = attn
    return random_llama(config, dtype, device)


def cache_bytes(cache) -> int:
    """Bytes of keys and values held by a cache."""
    total = 0
    for layer in cache.layers:
        nbytes = getattr(layer, "nbytes", None)
        if callable(nbytes):
            total += nbytes()
        elif getattr(layer, "keys", None) is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


@torch.no_grad()
def prefill(model, ids, method: str, budget: int, window: int):
    """One prefill with ``method`` -> (wall s, process CPU s, peak extra bytes, KV bytes held)."""
    device = device_of(model)
    restkv.configure(model, method=method, max_capacity_prompt=budget, window_size=window)
    with PeakMemory(device) as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync(device)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    return seconds, cpu, mem.extra, cache_bytes(cache)


def synthetic_cache(model, length: int, budget: int | None, device: str, dtype: torch.dtype) -> DynamicCache:
    """A cache as after a prefill of ``length`` tokens: full, or compressed to ``budget`` entries per KV head."""
    cfg = model.config
    kept = length if budget is None else min(budget, length)
    shape = (1, cfg.num_key_value_heads, kept, cfg.head_dim)
    layers = []
    for _ in range(cfg.num_hidden_layers):
        k = torch.randn(shape, device=device, dtype=dtype)
        v = torch.randn(shape, device=device, dtype=dtype)
        if budget is None or kept == length:
            layer = DynamicLayer()
            layer.update(k, v)
        else:
            idx = torch.arange(length - kept, length, device=device)
            positions = idx.expand(1, cfg.num_key_value_heads, kept)
            valid = torch.ones(1, kept, dtype=torch.bool, device=device)
            layer = CompressedLayer(Kept(k, v, positions, valid), seen=length)
        layers.append(layer)
    return DynamicCache(layers=layers) if _accepts_layers() else _with_layers(model, layers)


def _accepts_layers() -> bool:
    import inspect

    return "layers" in inspect.signature(DynamicCache.__init__).parameters


def _with_layers(model, layers):
    cache = DynamicCache(config=model.config)
    cache.layers = layers
    return cache


@torch.no_grad()
def decode_ms(model, cache, length: int, steps: int) -> float:
    """Median ms per token of greedy decoding ``steps`` tokens after a prompt of ``length``."""
    device = device_of(model)
    tok = torch.zeros(1, 1, dtype=torch.long, device=device)
    times = []
    for i in range(steps + 1):  # the first step is a warm-up
        pos = torch.full((1, 1), length + i, dtype=torch.long, device=device)
        sync(device)
        t0 = time.perf_counter()
        logits = model(input_ids=tok, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attn", default=None,
                   help="eager, sdpa or flash_attention_2; default flash_attention_2 on CUDA if installed, else sdpa")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--methods", nargs="+", default=["snapkv", "pyramidkv", "restkv", "streamingllm"])
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[2048])
    p.add_argument("--prefill-budget", type=int, default=1024)
    p.add_argument("--decode-lengths", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="decoded tokens per measurement")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cuda = args.device.startswith("cuda")
    attn = args.attn or ("flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa")
    max_len = max(args.prefill_lengths + args.decode_lengths) + args.steps + 8
    model = build_model(args.preset, args.layers, args.device, dtype, attn, max_len)
    cfg = model.config
    print(f"random Llama: {cfg.num_hidden_layers} layers, hidden 4096, 32 q / 8 KV heads, head_dim 128, "
          f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}; {args.device} {args.dtype} {attn}"
          + (f", {args.threads} threads" if args.device == "cpu" else "") + "\n")

    if args.decode_lengths:
        restkv.configure(model, method="snapkv", max_capacity_prompt=max(args.budgets), window_size=args.window)
        print(f"decode (median of {args.steps} tokens, batch 1)\n")
        print("| L | cache | KV held (MiB) | ms / token | speedup vs full |")
        print("|---|---|---|---|---|")
        for length in args.decode_lengths:
            full = None
            for budget in [None] + args.budgets:
                cache = synthetic_cache(model, length, budget, device_of(model), dtype)
                held = cache_bytes(cache)
                ms = decode_ms(model, cache, length, args.steps)
                del cache
                full = full or ms
                name = "full" if budget is None else f"budget {budget}"
                print(f"| {length} | {name} | {held / 2**20:.1f} | {ms:.2f} | {full / ms:.2f} |", flush=True)
        print()
    if args.prefill_lengths:
        if not cuda:
            ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD, fixed
        print(f"prefill (budget {args.prefill_budget}, window {args.window})\n")
        print("| L | method | prefill wall (s) | x full | CPU (s) | x full | peak extra (MiB) | KV held (MiB) |")
        print("|---|---|---|---|---|---|---|---|")
        for length in args.prefill_lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, length), device=device_of(model))
            warm = min(length, 4 * args.window + 256)
            for method in ["fullkv"] + args.methods:  # warm-ups that evict (a budget under the short prompt)
                prefill(model, ids[:, :warm], method, min(args.prefill_budget, warm // 2), args.window)
            full = None
            for method in ["fullkv"] + args.methods:
                s, cpu, peak, held = prefill(model, ids, method, args.prefill_budget, args.window)
                full = full or (s, cpu)
                print(f"| {length} | {method} | {s:.2f} | {s / full[0]:.3f} | {cpu:.2f} | {cpu / full[1]:.3f} | "
                      f"{peak / 2**20:.0f} | {held / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
