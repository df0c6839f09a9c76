"""KV bytes held and decode speed with per-head budgets (AdaKV): uniform vs masked vs variable-length.

One prefill of a long essay prompt on a real model builds the three caches (sweep mode); each then
decodes the same tokens, timed per token, the caches taking turns token by token (so a busy machine
slows all of them alike). The masked layout pads every head to the longest one and masks the rest
(what kvpress does); the variable-length layout packs each head's entries.

    python benchmarks/head_budgets.py --length 8192 --budget 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import restkv
from restkv.bench.models import add_model_flags, essays_text, model_from_flags
from restkv.cache import held_bytes

VARIANTS = {
    "uniform (snapkv)": dict(method="snapkv"),
    "adakv, masked": dict(method="adakv", varlen=False),
    "adakv, variable-length": dict(method="adakv", varlen=True),
}


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    model, tokenizer = model_from_flags(args)
    text = essays_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.length]
    configs = [dict(max_capacity_prompt=args.budget, **kw) for kw in VARIANTS.values()]
    caches = restkv.sweep_caches(model, ids, None, [dict(method="fullkv")] + configs).caches
    restkv.configure(model, method="fullkv")
    tokens = torch.randint(0, tokenizer.vocab_size, (args.steps,))
    print(f"{args.model_path}, prompt {ids.shape[1]} tokens, budget {args.budget}, {args.threads} CPU thread(s)\n")
    names = ["full"] + list(VARIANTS)
    times, logits = {name: [] for name in names}, {name: [] for name in names}
    for t in tokens:
        for name, cache in zip(names, caches):
            start = time.perf_counter()
            out = model(t.view(1, 1), cache=cache, use_cache=True)
            times[name].append(time.perf_counter() - start)
            logits[name].append(out.logits[0, -1])
    ms = {name: 1000 * statistics.median(times[name]) for name in names}
    held = {name: sum(held_bytes(layer) for layer in cache.layers) for name, cache in zip(names, caches)}
    print("| cache | KV held (MiB) | vs full | vs masked | decode ms/token (median) | vs masked |")
    print("|---|---|---|---|---|---|")
    masked = "adakv, masked"
    for name in names:
        print(f"| {name} | {held[name] / 2**20:.2f} | {held[name] / held['full']:.3f} | "
              f"{held[name] / held[masked]:.3f} | {ms[name]:.1f} | {ms[name] / ms[masked]:.2f} |")
    diff = (torch.stack(logits["adakv, variable-length"]) - torch.stack(logits[masked])).abs().max()
    print(f"\nlargest logit difference, variable-length vs masked, over {args.steps} tokens: {float(diff):.2e}")


if __name__ == "__main__":
    main()
