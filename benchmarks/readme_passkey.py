"""The README's first example at several budgets: each config's answer and the key's share kept.

The README's prompt (a 5-digit pass key, 60 repeats of filler, then the question; 621 tokens on
SmolLM2) is prefilled once and every config decodes from its own evicted cache (sweep mode, equal
to ``configure()`` + ``generate()`` per config). "key kept" is the share of the key's tokens kept,
averaged over layers and KV heads.

    python benchmarks/readme_passkey.py --budgets 128 192 256 320 384 512
"""

from __future__ import annotations

import argparse

import torch

import restkv
from restkv.bench.models import add_model_flags, model_from_flags

TEXT = ("The pass key is 71432. " + "The grass is green. The sky is blue. " * 60
        + "What is the pass key? The pass key is")
KEY = "71432"
CONFIGS = {"ReST-KV, paper": dict(preset="paper"),
           "ReST-KV, default": dict(method="restkv", window_size=32),
           "SnapKV": dict(method="snapkv", window_size=32)}


def key_span(tokenizer, text, key):
    """Token positions ``[start, end)`` of ``key`` in ``text``."""
    start = text.index(key)
    offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    end = start + len(key)
    inside = [i for i, (a, b) in enumerate(offsets) if b > a and a >= start and b <= end]
    return inside[0], inside[-1] + 1


def key_kept(kept, span):
    """Share of the positions ``span`` kept, averaged over layers and KV heads (sample 0)."""
    layers = [k[0] for k in kept if k is not None]
    positions = torch.arange(*span, device=layers[0].device)
    shares = [(k.unsqueeze(-1) == positions).any(-2).float().mean() for k in layers]
    return float(torch.stack(shares).mean())


def main(argv=None):
    parser = add_model_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--budgets", nargs="+", type=int, default=[128, 192, 256, 320, 384, 512])
    parser.add_argument("--max_new_tokens", type=int, default=6)
    args = parser.parse_args(argv)
    model, tokenizer = model_from_flags(args)
    inputs = tokenizer(TEXT, return_tensors="pt")
    span = key_span(tokenizer, TEXT, KEY)
    configs = [("full cache", None, dict(method="fullkv"))]
    for b in args.budgets:
        configs += [(name, b, {**knobs, "max_capacity_prompt": b})
                    for name, knobs in CONFIGS.items()]
    kwargs = [kw for _, _, kw in configs]
    results = restkv.sweep(model, inputs.input_ids, inputs.attention_mask, kwargs,
                           max_new_tokens=args.max_new_tokens)
    length = inputs.input_ids.shape[1]
    print(f"prompt: {length} tokens; the key's tokens: positions {span[0]}-{span[1] - 1}\n")
    print("| config | budget | answer | right | key kept |\n|---|---|---|---|---|")
    for (name, budget, _), (tokens, kept) in zip(configs, results):
        answer = tokenizer.decode(tokens[0], skip_special_tokens=True)
        share = "1.000" if budget is None else f"{key_kept(kept, span):.3f}"
        right = "yes" if answer.strip().startswith(KEY) else "no"
        print(f"| {name} | {budget or '-'} | {answer!r} | {right} | {share} |")


if __name__ == "__main__":
    main()
