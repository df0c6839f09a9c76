"""A long generation with the cache bounded while decoding (``decode_interval``): fidelity and speed.

One prefill of an essay prompt builds every config's cache (sweep mode); then every cache reads the same
teacher-forced continuation of the essay token by token, the caches taking turns token by token (so a busy
machine slows all of them alike). Fidelity is the KL divergence from the full-cache model's next-token
distribution at every step, KL(full || config), and how often both rank the same token first; speed is
decoded tokens per second over the whole run (evictions included). "prefill only" evicts at prefill and
then grows by every decoded token; the bounded configs evict again every ``--interval`` tokens, so they
never hold more than ``--budget + --interval`` entries per KV head.

    python benchmarks/decode_eviction.py --prompt 1024 --tokens 2048 --budget 512 --interval 64
"""

from __future__ import annotations

import argparse
import time

import torch

import restkv
from restkv.bench.models import add_model_flags, essays_text, model_from_flags
from restkv.cache import held_bytes


def variants(budget, interval):
    bounded = dict(max_capacity_prompt=budget, decode_interval=interval)
    return {
        "full": dict(method="fullkv"),
        "snapkv, prefill only": dict(method="snapkv", max_capacity_prompt=budget),
        "streamingllm": dict(method="streamingllm", **bounded),
        "snapkv": dict(method="snapkv", **bounded),
        "restkv": dict(method="restkv", **bounded),
        "adakv (variable-length)": dict(method="adakv", **bounded),
    }


def held_per_head(cache) -> int:
    """The most entries any KV head of any layer holds."""
    return max(int(layer.lengths.max()) if hasattr(layer, "lengths") else layer.keys.shape[-2]
               for layer in cache.layers)


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=2048, help="teacher-forced tokens decoded after the prompt")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--interval", type=int, default=64)
    args = parser.parse_args(argv)
    model, tokenizer = model_from_flags(args)
    text = essays_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.prompt + args.tokens]
    prompt, forced = ids[:, : args.prompt], ids[0, args.prompt:]
    configs = variants(args.budget, args.interval)
    pre = restkv.sweep_caches(model, prompt, None, list(configs.values()))
    restkv.configure(model, method="fullkv")  # decoding reads each cache's own layers
    names = list(configs)
    seconds = dict.fromkeys(names, 0.0)
    kl, agree, most = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for t in forced.tolist():
        logp = {}
        for name, cache in zip(names, pre.caches):
            start = time.perf_counter()
            out = model(torch.tensor([[t]]), cache=cache, use_cache=True)
            seconds[name] += time.perf_counter() - start
            logp[name] = out.logits[0, -1].double().log_softmax(-1)
        for name, cache in zip(names, pre.caches):
            kl[name] += float((logp["full"].exp() * (logp["full"] - logp[name])).sum())
            agree[name] += int(logp[name].argmax() == logp["full"].argmax())
            most[name] = max(most[name], held_per_head(cache) + 1)  # + the next step's own entry
    n = len(forced)
    print(f"{args.model_path}, prompt {prompt.shape[1]} tokens, {n} teacher-forced tokens, budget {args.budget}, "
          f"decode_interval {args.interval}, {args.threads} CPU thread(s)\n")
    print("| cache | most entries per KV head | KV held at the end (MiB) | KL to full (mean, nats) | "
          "same top-1 as full | tokens/s | vs full |")
    print("|---|---|---|---|---|---|---|")
    for name, cache in zip(names, pre.caches):
        held = sum(held_bytes(layer) for layer in cache.layers)
        print(f"| {name} | {most[name]} | {held / 2**20:.1f} | {kl[name] / n:.4f} | {agree[name] / n:.3f} | "
              f"{n / seconds[name]:.1f} | {seconds['full'] / seconds[name]:.2f} |")


if __name__ == "__main__":
    main()
