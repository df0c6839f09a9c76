"""restkv against the authors' released ReST-KV code, on identical inputs: kept sets per head.

The authors' eviction classes (``restkv/restkv_utils.py`` of https://github.com/an-yongqi/rest-kv) are
imported from a checkout you give (``--original``); nothing of theirs ships here. Inputs: random MHA
tensors, and real SmolLM2 attention (the packaged model, an essay window) with its keys and values
expanded to the query heads for the original, which keeps one set per query head; restkv runs with
``gqa_agg="none"`` (one set per query head as well) and the same knobs. Everything in float32.

    git clone https://github.com/an-yongqi/rest-kv /tmp/rest-kv
    python benchmarks/original_compare.py --original /tmp/rest-kv

Prints one table: per configuration and input, the Jaccard similarity of the kept positions (mean over
heads, worst head). 1.000 everywhere means the same entries for every head.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from restkv.eviction.plans import plan_layers
from restkv.integration.attachment import attached
from restkv.bench.models import essays_dir, load_model
from restkv.config import CompressionConfig
from restkv.scoring.observe import Observation, wo_factor
from restkv.eviction.select import select

PAPER = dict(use_wo=True, use_ema=True, alpha=0.3, metric_mode="after", tau=1, pooling="adaptive")
# (name, the original's class and arguments, restkv's knobs); B and w come from the command line.
PAIRS = [
    ("paper, scale 2000", ("RestKVCluster", dict(PAPER, kernel_size=5, scale=2000)), dict(preset="paper")),
    ("paper, scale 200", ("RestKVCluster", dict(PAPER, kernel_size=5, scale=200)), dict(preset="paper", scale=200.0)),
    ("paper, scale 50", ("RestKVCluster", dict(PAPER, kernel_size=5, scale=50)), dict(preset="paper", scale=50.0)),
    ("paper, scale 20", ("RestKVCluster", dict(PAPER, kernel_size=5, scale=20)), dict(preset="paper", scale=20.0)),
    ("before, use_norm, mean, avgpool 5", ("RestKVCluster", dict(use_wo=True, use_norm=True, metric_mode="before",
                                                                 pooling="avgpool", kernel_size=5)),
     dict(metric_mode="before", use_norm=True, temporal="mean", pooling="avgpool", kernel_size=5)),
    ("value space, after, mean, maxpool 7", ("RestKVCluster", dict(use_wo=False, metric_mode="after",
                                                                   pooling="maxpool", kernel_size=7)),
     dict(use_wo=False, temporal="mean", pooling="maxpool", kernel_size=7)),
    ("ablation attn", ("AblationCluster", dict(indicator="attn", ts="none", ss="none")),
     dict(indicator="attn", temporal="mean", pooling="avgpool", kernel_size=5)),
    ("ablation attn-v", ("AblationCluster", dict(indicator="attn-v", ts="none", ss="none")),
     dict(indicator="attn-v", temporal="mean", pooling="avgpool", kernel_size=5)),
    ("ablation recon, ts none, ss none", ("AblationCluster", dict(indicator="reconstruction", ts="none", ss="none")),
     dict(preset="paper", temporal="last", pooling="none")),
    ("ablation recon, ts inv-ema, ss maxpool", ("AblationCluster", dict(indicator="reconstruction", ts="inv-ema",
                                                                        ss="maxpool")),
     dict(preset="paper", temporal="inv-ema", pooling="maxpool")),
    ("snapkv, avgpool 5", ("SnapKVCluster", dict(pooling="avgpool", kernel_size=5)),
     dict(method="snapkv", pooling="avgpool", kernel_size=5)),
]


def load_original(checkout: Path):
    path = checkout / "restkv" / "restkv_utils.py"
    if not path.is_file():
        sys.exit(f"--original: {path} not found (a checkout of https://github.com/an-yongqi/rest-kv)")
    spec = importlib.util.spec_from_file_location("rest_kv_original", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def original_kept(module, cls, kwargs, q, k, v, wo, budget, window):
    """Positions [Hq, B] the original keeps (its keys are matched back to positions; keys are distinct)."""
    cluster = getattr(module, cls)(window_size=window, max_capacity_prompt=budget, **kwargs)
    args = (k, q, v, None, 1, wo) if cls != "SnapKVCluster" else (k, q, v, None, 1)
    kept, _ = cluster.update_kv(*args)
    distance = (kept[0][:, :, None, :] - k[0][:, None, :, :]).abs().sum(-1)  # [H, B, L]
    return distance.argmin(-1).sort(-1).values


def restkv_kept(knobs, q, k, v, wo, budget, window):
    """Positions [Hq, B] restkv keeps with ``gqa_agg="none"`` (one set per query head)."""
    hq = q.shape[1]
    obs = Observation(q, k, v, torch.ones(1, q.shape[2], dtype=torch.bool), window=window, budget=budget,
                      scaling=q.shape[-1] ** -0.5, wo_factor=wo_factor(wo, hq))
    cfg = CompressionConfig(max_capacity_prompt=budget, window_size=window, gqa_agg="none", **knobs)
    pos = select(obs, cfg).positions[0]
    return (pos if pos.shape[0] == hq else pos.repeat_interleave(hq // pos.shape[0], 0)).sort(-1).values


def jaccard(a, b):
    values = [len(set(x.tolist()) & set(y.tolist())) / len(set(x.tolist()) | set(y.tolist())) for x, y in zip(a, b)]
    return sum(values) / len(values), min(values)


def inputs(length: int, seed: int, layers: list[int]):
    """(name, q [1,Hq,L,d], k and v [1,Hkv,L,d], o_proj weight) of random MHA tensors and SmolLM2 layers."""
    g = torch.Generator().manual_seed(seed)
    heads, d = 4, 16
    yield "random MHA", *(torch.randn(1, heads, length, d, generator=g) for _ in range(3)), torch.randn(24, heads * d,
                                                                                                       generator=g)
    model, tokenizer = load_model("smollm2-135m")
    text = "\n\n".join(p.read_text() for p in sorted(Path(essays_dir()).glob("*.txt"))[:3])
    ids = torch.tensor([tokenizer(text).input_ids[:length]])
    captured = {}

    def grab(state, module, query, key, value, mask, kwargs):
        captured[module.layer_idx] = (query, key, value, module.o_proj.weight.detach())

    with torch.no_grad(), attached(model, plan_layers(model, CompressionConfig(method="fullkv")), on_prefill=grab):
        model(ids, logits_to_keep=1)
    for layer in layers:
        yield f"SmolLM2 layer {layer}", *captured[layer]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--original", type=Path, required=True, help="checkout of github.com/an-yongqi/rest-kv")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--layers", type=int, nargs="+", default=[10, 29])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    module = load_original(args.original)
    torch.set_num_threads(1)
    print(f"| configuration | inputs | L | B | Jaccard (mean over heads) | worst head |\n|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, q, k, v, wo in inputs(args.length, args.seed, args.layers):
            g = q.shape[1] // k.shape[1]
            k_q, v_q = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            for label, (cls, kwargs), knobs in PAIRS:
                a = original_kept(module, cls, kwargs, q, k_q, v_q, wo, args.budget, args.window)
                b = restkv_kept(knobs, q, k, v, wo, args.budget, args.window)
                mean, worst = jaccard(a, b)
                print(f"| {label} | {name} | {q.shape[2]} | {args.budget} | {mean:.4f} | {worst:.4f} |", flush=True)


if __name__ == "__main__":
    main()
