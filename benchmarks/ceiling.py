"""Hindsight ceilings beside real configs: KL to the full cache of selections that saw the continuation.

A real method picks the kept entries from the prompt alone. The hindsight selections also see the
queries of the continuation, as the full-cache model computes them (one full-cache forward over prompt +
continuation; every evicted layer's queries post-RoPE, as the attention backend receives them):

- ``future_attention``: the mean over those queries of their attention on each prompt key (the softmax
  over every key they see, the continuation's own included), mean over the GQA group;
- ``future_restkv``: ReST-KV's indicator ``A / (1 - A) * ||(o - v_n) W_O^h||`` (``restkv.methods.restkv``,
  knobs ``--future_restkv``, default without pooling) on an Observation of that forward whose window is
  the continuation, so its prefix is the whole prompt;
- ``future_setlevel``: ``future_attention``'s set improved by a swap search on the layer-output error of
  those queries (ReST-KV's objective, ``hindsight.swap_search``; ``--rounds``, ``--pool``, ``--batch``,
  ``--pool_by``), in every evicted layer.

Each keeps B - w prefix entries per KV head plus the prompt's last w tokens (``--window_size``, default 32),
as every real config does. The observed queries are those of the teacher-forced tokens, the only ones
that read the evicted cache. Every cache (``hindsight.cache_layer``: restkv's ``CompressedLayer``) is
teacher-forced and scored with benchmarks/fidelity.py's functions, beside the ``--method`` / ``--variant``
configs (``restkv.sweep_caches`` on the same samples). Tables: KL (mean ± s.e. over samples), the share of
the gap from ``--reference`` (StreamingLLM) to each ceiling that a row closes, ``(KL_ref - KL_x) / (KL_ref -
KL_ceiling)``, and the layer-output error of every row's kept sets (relative to ``||sum_h W_O^h o_h||``,
mean over layers and queries).

    python benchmarks/ceiling.py --method streamingllm snapkv adakv restkv --variant restkv_paper preset=paper \\
        --max_capacity_prompts 128 256 512 --output results/ceiling.json

``--output`` is rewritten after every sample and a rerun with the same rows and budgets resumes from it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

import restkv
from restkv.eviction.plans import attention_modules, plan_layers
from restkv.integration.attachment import attached
from restkv.bench.cli import add_common_args
from restkv.bench.grid import method_configs, parse_knobs
from restkv.bench.models import load_from_args
from restkv.config import CompressionConfig
from restkv.eviction.observation import layer_wo_factor
from restkv.scoring.observe import Observation, weighted_values
from restkv.eviction.select import head_scores

import hindsight
from fidelity import essay_samples, kl, teacher_forced

HINDSIGHT = ("future_attention", "future_restkv", "future_setlevel")
CEILINGS = ("future_attention", "future_setlevel")


@torch.no_grad()
def capture(model, ids: torch.Tensor, observed: int) -> list[tuple[int, torch.nn.Module, Observation]]:
    """One full-cache forward over ``ids`` [n]: per evicted layer ``(layer_idx, module, Observation)`` of its
    prefill tensors, whose window is the last ``observed`` tokens."""
    plans = plan_layers(model, CompressionConfig(method="fullkv"))  # evicts nothing; every evicted layer reports
    found = []

    def record(state, module, query, key, value, attention_mask, kwargs):
        obs = Observation(queries=query, keys=key, values=value, key_valid=torch.ones(key.shape[0], key.shape[2],
                          dtype=torch.bool, device=key.device), window=observed, budget=key.shape[2],
                          scaling=kwargs.get("scaling") or module.head_dim**-0.5, softcap=kwargs.get("softcap"),
                          wo_factor=lambda: layer_wo_factor(module, query.device), layer=state.plan.rank,
                          num_layers=state.plan.num_evicted)
        found.append((module.layer_idx, module, obs))

    with attached(model, plans, on_prefill=record):
        model(ids[None], use_cache=True, logits_to_keep=1)
    return found


def hindsight_sets(obs: Observation, o_proj_weight, budgets, window: int, future_cfg, search: dict) -> dict:
    """Per budget ``(sets, swaps, seconds)``: each hindsight selection's kept set [b, Hkv, P] (None: the budget
    keeps the whole prompt), the swap search's number of swaps and its wall time."""
    length = obs.prefix_len  # the prompt
    prefix, hkv = length - window, obs.keys.shape[1]
    attention = obs.window_attention
    by_attention = hindsight.future_attention(attention, hkv, prefix)
    layer = hindsight.layer_terms(obs.values, o_proj_weight, prefix) if min(budgets) < length else None
    out = {}
    for budget in budgets:
        if budget >= length:
            out[budget] = dict.fromkeys(HINDSIGHT), 0, 0.0
            continue
        count = budget - window
        at_budget = dataclasses.replace(obs, budget=count + obs.window)  # ReST-KV's drift reads budget - window
        sets = {"future_attention": hindsight.top_set(by_attention, count),
                "future_restkv": hindsight.top_set(head_scores(at_budget, future_cfg)[..., :prefix], count)}
        start = time.perf_counter()
        sets["future_setlevel"], _, swaps = hindsight.swap_search(attention, obs.values, sets["future_attention"],
                                                                  by_attention, o_proj_weight, layer=layer, **search)
        out[budget] = sets, int(swaps.sum()), time.perf_counter() - start
    return out


def with_layers(full, layers: dict):
    """A cache like ``full`` with ``layers`` {layer_idx: cache layer} in place of its own (the rest shallow copies)."""
    cache = copy.copy(full)
    cache.layers = [layers.get(j) or copy.copy(layer) for j, layer in enumerate(full.layers)]
    return cache


@torch.no_grad()
def sample_values(model, ids: torch.Tensor, length: int, rows: list, budgets: list, window: int, future_cfg,
                  search: dict) -> dict:
    """Every row's KL and layer-output error at every budget on one sample ``ids`` [length + continuation].

    ``rows``: the real configs as ``(row, budget, configure kwargs)``. Returns ``{"kl": {row: {budget: x}},
    "error": {row: {budget: x}}, "swaps": {budget: n}, "seconds": {budget: s}}`` (budgets as str).
    """
    observed = ids.numel() - 1 - length
    layers = capture(model, ids[:-1], observed)
    pre = restkv.sweep_caches(model, ids[None, :length], None, [{"method": "fullkv"}] + [kw for *_, kw in rows])
    full, index = pre.caches[0], {mod: i for i, mod in enumerate(attention_modules(model))}
    built = {(name, b): {} for name in HINDSIGHT for b in budgets}
    errors = {key: [] for key in [*built, *((row, b) for row, b, _ in rows)]}
    swaps, seconds = dict.fromkeys(budgets, 0), dict.fromkeys(budgets, 0.0)
    for layer_idx, module, obs in layers:
        w_o = module.o_proj.weight
        sets = hindsight_sets(obs, w_o, budgets, window, future_cfg, search)
        attention = obs.window_attention
        o = weighted_values(attention, obs.values)
        scale = (o.transpose(1, 2).flatten(2) @ w_o.float().T).norm(dim=-1)  # ||sum_h W_O^h o_h|| [b, r]
        prompt = full.layers[layer_idx]
        for budget, (kept, n_swaps, search_time) in sets.items():
            swaps[budget] += n_swaps
            seconds[budget] += search_time
            for name, keep in kept.items():
                if keep is not None:
                    built[name, budget][layer_idx] = hindsight.cache_layer(keep, prompt.keys, prompt.values)
                    keep_all = keep
                else:
                    keep_all = torch.ones_like(obs.keys[:, :, :1, 0], dtype=torch.bool)
                errors[name, budget].append(hindsight.layer_output_error(attention, obs.values, keep_all, w_o) / scale)
        for c, (row, budget, _) in enumerate(rows, start=1):
            keep = hindsight.positions_mask(pre.kept[c][index[module]], length)
            errors[row, budget].append(hindsight.layer_output_error(attention, obs.values, keep, w_o) / scale)
    caches = [full] + pre.caches[1:] + [with_layers(full, layers) for layers in built.values()]
    reference, *others = teacher_forced(model, ids, length, pre.logits, caches)
    names = [(row, b) for row, b, _ in rows] + list(built)
    out = {"kl": {}, "error": {}, "swaps": {str(b): n for b, n in swaps.items()},
           "seconds": {str(b): s for b, s in seconds.items()}}
    for (row, budget), logprobs in zip(names, others):
        out["kl"].setdefault(row, {})[str(budget)] = kl(reference, logprobs)
        out["error"].setdefault(row, {})[str(budget)] = float(torch.stack(errors[row, budget]).mean())
    return out


def real_rows(args) -> list[tuple[str, int, dict]]:
    """The ``--method`` / ``--variant`` configs as ``(row, budget, kwargs)``: the label without its budget."""
    out = []
    for label, kwargs in method_configs(args):
        if kwargs["method"] != "fullkv":
            budget = kwargs["max_capacity_prompt"]
            out.append((re.sub(rf"_{budget}(?=-|$)", "", label, count=1), budget, kwargs))
    taken = sorted({row for row, *_ in out} & set(HINDSIGHT))
    if taken:
        raise ValueError(f"variant: the names {taken} are the hindsight rows'")
    return out


def check_args(args) -> tuple:
    """Validate the flags before any work; returns (budgets, window, future config, search knobs)."""
    budgets = list(dict.fromkeys(args.max_capacity_prompts))
    window = args.window_size if args.window_size is not None else CompressionConfig(method="snapkv").window_size
    if min(budgets) <= window:
        raise ValueError(f"max_capacity_prompts: every budget must exceed window_size {window}, got {budgets}")
    if args.continuation < 2:
        raise ValueError(f"continuation: at least 2 tokens (one teacher-forced query), got {args.continuation}")
    for name in ("rounds", "pool", "batch"):
        if getattr(args, name) < (0 if name == "rounds" else 1):
            raise ValueError(f"{name}: must be >= {0 if name == 'rounds' else 1}, got {getattr(args, name)}")
    try:
        future = CompressionConfig.from_kwargs(**{"method": "restkv", **parse_knobs(args.future_restkv)})
    except ValueError as err:
        raise ValueError(f"future_restkv: {err}") from None
    if future.method != "restkv" or future.get("gqa_agg") == "none":
        raise ValueError("future_restkv: ReST-KV knobs with one set per KV head (method restkv, gqa_agg not none)")
    return budgets, window, future, {k: getattr(args, k) for k in ("rounds", "pool", "batch", "pool_by")}


def _cell(values) -> str:
    t = torch.tensor(values)
    se = float(t.std() / math.sqrt(len(values))) if len(values) > 1 else float("nan")
    return f"{float(t.mean()):.4f} ± {se:.4f}"


def tables(store: dict, budgets, reference: str) -> str:
    """The KL, gap and layer-error tables of a run's per-sample values."""
    head = "| {} | " + " | ".join(f"B={b}" for b in budgets) + " |\n|---|" + "---|" * len(budgets) + "\n"
    kl_, err = store["kl"], store["error"]
    n = len(next(iter(kl_.values()))[str(budgets[0])])
    text = f"KL to the full cache ({n} samples, mean ± s.e.):\n\n" + head.format("selection")
    text += "".join(f"| {row} | " + " | ".join(_cell(v[str(b)]) for b in budgets) + " |\n" for row, v in kl_.items())
    matches = [row for row in kl_ if row == reference] or [row for row in kl_ if row.split("-")[0] == reference]
    if len(matches) == 1:  # the row itself, or the one config of that method (whose label names its knobs)
        reference = matches[0]
        mean = {row: {b: sum(v[str(b)]) / n for b in budgets} for row, v in kl_.items()}

        def closed(row, b, ceiling):
            gap = mean[reference][b] - mean[ceiling][b]
            return f"{(mean[reference][b] - mean[row][b]) / gap:.2f}" if gap > 0 else "-"

        text += (f"\nShare of the gap {reference} -> ceiling closed, (KL_{reference} - KL_x) / (KL_{reference} - "
                 f"KL_ceiling), ceiling {' / '.join(CEILINGS)}:\n\n" + head.format("selection"))
        text += "".join(f"| {row} | " + " | ".join(" / ".join(closed(row, b, c) for c in CEILINGS) for b in budgets)
                        + " |\n" for row in kl_)
    text += ("\nLayer-output error of the kept sets, ||sum_h W_O^h (o_h - o_h^S)|| / ||sum_h W_O^h o_h||, mean over "
             "evicted layers and observed queries:\n\n" + head.format("selection"))
    text += "".join(f"| {row} | " + " | ".join(_cell(v[str(b)]) for b in budgets) + " |\n" for row, v in err.items())
    swaps = " | ".join(f"{sum(store['swaps'][str(b)]) / n:.0f} swaps, {sum(store['seconds'][str(b)]) / n:.1f} s"
                       for b in budgets)
    return text + f"\nSwap search per sample (all layers and heads): | {swaps} |\n"


def main(argv=None):
    parser = add_common_args(argparse.ArgumentParser(description=__doc__,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.set_defaults(default_methods=["streamingllm", "snapkv", "adakv", "restkv"])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=24)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--future_restkv", default="pooling=none",
                        help="knobs of future_restkv's ReST-KV score (knob=value,...)")
    parser.add_argument("--rounds", type=int, default=64, help="swap search: most rounds per layer and budget")
    parser.add_argument("--pool", type=int, default=32, help="swap search: candidates per head on each side")
    parser.add_argument("--batch", type=int, default=32, help="swap search: most swaps per head in one round")
    parser.add_argument("--pool_by", default="effect", choices=("effect", "score"),
                        help="swap search pools: the entries whose own change of side lowers the error most "
                             "(effect), or the kept of lowest and evicted of highest future_attention (score)")
    parser.add_argument("--reference", default="streamingllm",
                        help="row the gap to a ceiling is measured from (or the method of the one such row)")
    parser.add_argument("--output", default=None,
                        help="JSON file of the per-sample values, rewritten after every sample; a rerun resumes it")
    args = parser.parse_args(argv)
    budgets, window, future_cfg, search = check_args(args)
    rows = real_rows(args)
    names = list(dict.fromkeys([*HINDSIGHT, *(row for row, *_ in rows)]))
    empty = {"kl": {r: {str(b): [] for b in budgets} for r in names},
             "error": {r: {str(b): [] for b in budgets} for r in names},
             "swaps": {str(b): [] for b in budgets}, "seconds": {str(b): [] for b in budgets}}
    store = empty
    if args.output and os.path.exists(args.output):
        done = json.loads(Path(args.output).read_text())
        if {k: {r: set(v) for r, v in done.get(k, {}).items()} for k in ("kl", "error")} == \
                {k: {r: set(v) for r, v in empty[k].items()} for k in ("kl", "error")}:
            store = done
    model, tokenizer, _ = load_from_args(args)
    samples = essay_samples(tokenizer, args.samples, args.length, args.continuation, args.seed)
    for i, ids in enumerate(samples):
        if all(len(v) > i for v in store["swaps"].values()):
            continue  # finished by an earlier run
        one = sample_values(model, ids.to(args.device), args.length, rows, budgets, window, future_cfg, search)
        for key in ("kl", "error"):
            for row, by_budget in one[key].items():
                for b, x in by_budget.items():
                    store[key][row][b] = store[key][row][b][:i] + [x]
        for key in ("swaps", "seconds"):
            for b, x in one[key].items():
                store[key][b] = store[key][b][:i] + [x]
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            tmp = args.output + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"args": vars(args), **store}, f, indent=1)
            os.replace(tmp, args.output)
        print(f"sample {i + 1}/{len(samples)} done", file=sys.stderr, flush=True)
    print(tables(store, budgets, args.reference))


if __name__ == "__main__":
    main()
