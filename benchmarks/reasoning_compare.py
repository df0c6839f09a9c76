"""restkv's ``rkv`` and ``triattention`` against the authors' code, on identical inputs: kept sets per KV head.

The authors' modules are imported from checkouts you give; nothing of theirs ships here:

- R-KV (``--rkv``, https://github.com/Zefan-Cai/R-KV): ``rkv/utils.py`` and ``rkv/compression/r1_kv.py``'s
  ``R1KV.update_kv``, given the keys and values held and the window's queries;
- TriAttention (``--triattention``, https://github.com/WeianMao/triattention):
  ``triattention/methods/triattention.py``'s per-(layer, KV head) selection
  (``_select_per_layer_perhead_independent``, its ``per_layer_perhead_pruning`` mode with z-scored scores,
  its runs' ``normalize_scores``) with the same statistics as restkv (``obs.data``), scoring every held
  entry (``allow_prefill_compression``), without its 1e-6 tie-breaking noise. Its default mode shares one
  set per KV head among the layers; the last row measures how far each layer's own set is from it.

Inputs: random GQA tensors (8 query / 2 KV heads, standard RoPE) and SmolLM2-135M layers (the packaged
model on an essay window: queries and keys after RoPE, values); "decoding" holds ``--budget + 128``
entries with only the window's queries (an eviction while decoding), "prefill" ``--length`` entries with
every query. Everything in float32.

    git clone https://github.com/Zefan-Cai/R-KV /tmp/R-KV
    git clone https://github.com/WeianMao/triattention /tmp/triattention
    python benchmarks/reasoning_compare.py --rkv /tmp/R-KV --triattention /tmp/triattention

Prints one table: per method, input and setting, the Jaccard similarity of the kept positions (mean over
KV heads and layers, worst head). 1.000 everywhere means the same entries for every head.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from restkv.bench.models import essays_dir, load_model
from restkv.config import CompressionConfig
from restkv.eviction.plans import plan_layers
from restkv.eviction.select import select
from restkv.integration.attachment import attached
from restkv.integration.triattention_stats import compute as triattention_stats
from restkv.scoring.observe import Observation
from restkv.scoring.rope import Rope, rotary_function


def load_rkv(checkout: Path):
    """R-KV's ``R1KV`` class, its package's ``__init__`` bypassed (it imports modules the repository lacks)."""
    utils_path, r1_path = checkout / "rkv" / "utils.py", checkout / "rkv" / "compression" / "r1_kv.py"
    if not r1_path.is_file():
        sys.exit(f"--rkv: {r1_path} not found (a checkout of https://github.com/Zefan-Cai/R-KV)")
    spec = importlib.util.spec_from_file_location("rkv_original_utils", utils_path)
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    package = types.ModuleType("rkv_original")
    package.__path__ = []
    package.cal_similarity, package.compute_attention_scores = utils.cal_similarity, utils.compute_attention_scores
    sys.modules["rkv_original"] = package
    spec = importlib.util.spec_from_file_location("rkv_original.r1_kv", r1_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.R1KV


def load_triattention(checkout: Path):
    """TriAttention's ``TriAttention`` class and ``HeadFrequencyStats``."""
    if not (checkout / "triattention" / "methods" / "triattention.py").is_file():
        sys.exit(f"--triattention: {checkout}/triattention/methods/triattention.py not found "
                 "(a checkout of https://github.com/WeianMao/triattention)")
    sys.path.insert(0, str(checkout))
    from triattention.methods.pruning_utils import HeadFrequencyStats, build_geometric_offsets
    from triattention.methods.triattention import TriAttention

    return TriAttention, HeadFrequencyStats, build_geometric_offsets


def jaccard(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Per row of two [H, K] position sets."""
    return [len(set(x.tolist()) & set(y.tolist())) / len(set(x.tolist()) | set(y.tolist())) for x, y in zip(a, b)]


def restkv_kept(method, q, k, v, rope, budget, window, data=None, **knobs) -> torch.Tensor:
    """Positions [Hkv, B - window] restkv keeps outside the window (keys held at positions 0..n-1)."""
    n = k.shape[2]
    obs = Observation(q, k, v, torch.ones(1, n, dtype=torch.bool), window=window, budget=budget,
                      scaling=q.shape[-1] ** -0.5, rope=rope, data=data)
    cfg = CompressionConfig(method=method, max_capacity_prompt=budget, window_size=window, **knobs)
    return select(obs, cfg).positions[0, :, : budget - window].sort(-1).values


def rkv_rows(R1KV, q, k, v, rope, budget, window):
    """(Jaccard per KV head) of R-KV's kept prefix entries and restkv's ``rkv``, window ``window``."""
    kept_k, _ = R1KV(budget=budget, window_size=window, mix_lambda=0.1).update_kv(k, q[:, :, -window:], v)
    distance = (kept_k[0, :, : budget - window, None, :] - k[0, :, None, :, :]).abs().sum(-1)  # [H, B - w, n]
    theirs = distance.argmin(-1).sort(-1).values
    return jaccard(theirs, restkv_kept("rkv", q, k, v, rope, budget, window))


def triattention_selector(TriAttention, Stats, offsets, rotary, mean, modulus, hkv, n):
    """A ``TriAttention`` set up as ``apply_triattention_patch`` would be, with ``mean`` [layers, Hq, d] and
    ``modulus`` [layers, Hq, d/2] as its statistics, scoring at next position ``n`` (no file, no noise)."""
    layers, hq, d = mean.shape
    t = object.__new__(TriAttention)
    t.config = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, layer_perhead_aggregation="max")
    t.sampled_heads = [(i, h) for i in range(layers) for h in range(hq)]
    t.head_stats = {(i, h): Stats(torch.complex(mean[i, h, : d // 2], mean[i, h, d // 2:]), modulus[i, h])
                    for i in range(layers) for h in range(hq)}
    t.rotary, t.rope_style, t.attention_scale = rotary, "half", float(getattr(rotary, "attention_scaling", 1.0))
    t.head_dim, t.omega, t.offsets = d, rotary.inv_freq.float()[: d // 2], offsets(65536, torch.device("cpu"))
    t.freq_scale_sq = torch.full((d // 2,), t.attention_scale**2)
    t.num_attention_heads, t.num_key_value_heads, t.num_key_value_groups = hq, hkv, hq // hkv
    t.normalize_scores, t.generator, t.score_aggregation = True, None, "mean"
    t.disable_mlr = t.disable_trig = False
    t.cache_positions_per_layer_perhead = None
    t.absolute_position = n
    return t


def triattention_rows(classes, rotary, layers, budget):
    """Per layer, (Jaccard per KV head) of TriAttention's per-layer sets and restkv's ``triattention`` (window
    1: the newest entry kept, the top ``budget - 1`` of the others), and of TriAttention's default (one set
    per KV head for every layer) against restkv's per-layer sets."""
    TriAttention, Stats, offsets = classes
    q, k, v, rope, mean, modulus = layers[0]
    hkv, n = k.shape[1], k.shape[2]
    t = triattention_selector(TriAttention, Stats, offsets, rotary, torch.stack([x[4] for x in layers]),
                              torch.stack([x[5] for x in layers]), hkv, n)
    pkv = tuple((x[1][:, :, : n - 1], x[2][:, :, : n - 1]) for x in layers)
    positions = torch.arange(n - 1)
    per_layer = t._select_per_layer_perhead_independent(pkv, budget - 1, 0, positions).sort(-1).values
    mine = [restkv_kept("triattention", x[0], x[1], x[2], x[3], budget, 1, data=(x[4], x[5])) for x in layers]
    matrix = torch.cat([t._compute_layer_head_scores(x[0], positions, i) for i, x in enumerate(pkv)])
    matrix = (matrix - matrix.mean(1, keepdim=True)) / matrix.std(1, unbiased=False, keepdim=True).clamp_min(1e-6)
    default = t._select_per_head_independent(matrix, budget - 1, 0).sort(-1).values
    same = [v for theirs, ours in zip(per_layer, mine) for v in jaccard(theirs, ours)]
    across = [v for ours in mine for v in jaccard(default, ours)]
    return same, across


def random_layers(n, seed, layers=2, hq=8, hkv=2, d=16):
    """[(q, k, v, rope, mean, modulus)] of random GQA layers with standard RoPE, and the rotary module."""
    g = torch.Generator().manual_seed(seed)
    rotary = LlamaRotaryEmbedding(LlamaConfig(head_dim=d, hidden_size=hq * d, num_attention_heads=hq))
    embed = rotary_function(rotary)
    rope = Rope.of(embed, torch.arange(n)[None])
    cos, sin = rope.cos[:, None], rope.sin[:, None]
    out = []
    for _ in range(layers):
        center = torch.randn(1, hq, 1, d, generator=g)
        q_pre = torch.randn(1, hq, n, d, generator=g) * 0.7 + center
        k_pre = torch.randn(1, hkv, n, d, generator=g) + torch.randn(1, hkv, 1, d, generator=g)
        q, k = (x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin for x in (q_pre, k_pre))
        v = torch.randn(1, hkv, n, d, generator=g)
        rows = q_pre[0]
        out.append((q, k, v, rope, rows.mean(1), torch.hypot(rows[..., : d // 2], rows[..., d // 2:]).mean(1)))
    return out, rotary


def smollm2_layers(n, layers):
    """SmolLM2-135M's layers ``layers`` on the first ``n`` tokens of the essays, TriAttention's statistics of
    the model (restkv's recipe, 8192 essay tokens), and its rotary module."""
    model, tokenizer = load_model("smollm2-135m")
    stats = triattention_stats(model, tokenizer, 8192)
    text = "\n\n".join(p.read_text() for p in sorted(Path(essays_dir()).glob("*.txt"))[:3])
    ids = torch.tensor([tokenizer(text).input_ids[:n]])
    captured = {}

    def grab(state, module, query, key, value, mask, kwargs):
        captured[module.layer_idx] = (query, key, value, state.rope)

    with torch.no_grad(), attached(model, plan_layers(model, CompressionConfig(method="fullkv")), on_prefill=grab):
        model(ids, logits_to_keep=1)
    return [(*captured[i], stats["query_mean"][i], stats["query_abs_mean"][i]) for i in layers], model.model.rotary_emb


def summary(values: list[float]) -> str:
    return f"{sum(values) / len(values):.4f} | {min(values):.4f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rkv", type=Path, required=True, help="checkout of github.com/Zefan-Cai/R-KV")
    p.add_argument("--triattention", type=Path, required=True, help="checkout of github.com/WeianMao/triattention")
    p.add_argument("--length", type=int, default=1024, help="entries held in the prefill setting")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--window", type=int, default=8, help="R-KV's window (its default: 8)")
    p.add_argument("--layers", type=int, nargs="+", default=[3, 10, 20, 29])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    R1KV, classes = load_rkv(args.rkv), load_triattention(args.triattention)
    torch.set_num_threads(1)
    print("| method | inputs | setting | held | B | Jaccard (mean) | worst head |\n|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for setting, n in (("decoding", args.budget + 128), ("prefill", args.length)):
            random, random_rotary = random_layers(n, args.seed)
            smol, smol_rotary = smollm2_layers(n, args.layers)
            for name, layers, rotary in (("random GQA", random, random_rotary), ("SmolLM2", smol, smol_rotary)):
                q_of = (lambda q: q[:, :, -args.window:]) if setting == "decoding" else (lambda q: q)
                values = [v for q, k, v_, rope, *_ in layers
                          for v in rkv_rows(R1KV, q_of(q), k, v_, rope, args.budget, args.window)]
                print(f"| rkv | {name} | {setting} | {n} | {args.budget} | {summary(values)} |", flush=True)
                same, across = triattention_rows(classes, rotary, layers, args.budget)
                print(f"| triattention (per layer) | {name} | {setting} | {n} | {args.budget} | {summary(same)} |")
                print(f"| triattention: its default (shared by the layers) vs restkv per layer | {name} | {setting} "
                      f"| {n} | {args.budget} | {summary(across)} |", flush=True)


if __name__ == "__main__":
    main()
