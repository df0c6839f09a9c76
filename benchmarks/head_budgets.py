"""KV bytes held and decode speed with per-head budgets (AdaKV): uniform vs masked vs variable-length.

One prefill of a long essay prompt on a real model builds the three caches (sweep mode); each then
decodes the same tokens, timed per token. The masked layout pads every head to the longest one and
masks the rest (what kvpress does); the variable-length layout packs each head's entries.

    python benchmarks/head_budgets.py --length 8192 --budget 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import restkv
from restkv.bench.models import essays_dir, load_model
from restkv.cache import held_bytes

VARIANTS = {
    "uniform (snapkv)": dict(method="snapkv"),
    "adakv, masked": dict(method="adakv", varlen=False),
    "adakv, variable-length": dict(method="adakv", varlen=True),
}


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_path)
    text = "\n\n".join(p.read_text() for p in sorted(Path(essays_dir()).glob("*.txt")))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.length]
    configs = [dict(max_capacity_prompt=args.budget, **kw) for kw in VARIANTS.values()]
    caches = restkv.sweep_caches(model, ids, None, [dict(method="fullkv")] + configs).caches
    restkv.configure(model, method="fullkv")
    tokens = torch.randint(0, tokenizer.vocab_size, (args.steps,))
    print(f"{args.model_path}, prompt {ids.shape[1]} tokens, budget {args.budget}, {args.threads} CPU thread(s)\n")
    print("| cache | KV held (MiB) | vs full | decode ms/token (median) |")
    print("|---|---|---|---|")
    full_bytes = None
    for name, cache in zip(["full"] + list(VARIANTS), caches):
        held = sum(held_bytes(layer) for layer in cache.layers)
        full_bytes = full_bytes or held
        times = []
        for t in tokens:
            start = time.perf_counter()
            model(t.view(1, 1), cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
        print(f"| {name} | {held / 2**20:.2f} | {held / full_bytes:.3f} | {1000 * statistics.median(times):.1f} |")


if __name__ == "__main__":
    main()
