"""Long generation: how each method holds up while it evicts during decoding, over thousands of tokens.

From a short prompt (the first ``--prompt`` tokens of an essay window; the windows of a set are disjoint,
and the held-out set overlaps none of the choice set's first 32, as the prompt arms' sets), the
full-cache model writes its own continuation of ``--tokens`` tokens (end-of-sequence suppressed): greedy,
or sampled with ``--temperature`` and ``--top_p`` (seeded by the window's start), as R-KV and TriAttention
evaluate (0.6, 0.95); the greedy continuations of the packaged models fall into loops.
Every config then reads that continuation teacher-forced on its own cache, evicting while decoding
(``decode_interval``) with budget B: at every generated position, KL(full || config) of the next-token
distributions and whether both rank the same token first, averaged in bins of ``--bin`` positions.

The continuation is fed in chunks of ``--chunk`` tokens (by default the intervals' greatest common
divisor): a layer evicts after a forward in which its count of new tokens reaches its interval, and a
chunk's token t attends to what a step-by-step decoding holds at t, so every config's distributions are
those of decoding one token at a time (tested on tiny models, ``tests/bench/test_long_generation.py``).
All configs share each sample's prefill (sweep mode) and go through the continuation chunk by chunk
together. ``--output`` is rewritten after every sample; a rerun resumes it, and computes only the configs
a finished sample lacks (its continuation is stored).

``--cost``: instead, the cost per generated token against the full cache: the first sample's
continuation decoded one token at a time (``--cost_tokens``), every config at ``--cost_budget`` taking
turns token by token, each token's CPU time (the process's, one thread) added to its config.

    nice -n 10 python scripts/study/long_generation.py --model_path smollm2-135m --set choice --samples 4 \\
        --output results/study/long_generation/smollm2-135m/choice.json
    nice -n 10 python scripts/study/long_generation.py --model_path smollm2-135m --cost \\
        --output results/study/long_generation/smollm2-135m/cost.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import restkv  # noqa: E402
from compress_step import named, parse_method  # noqa: E402
from fidelity import held_out_samples  # noqa: E402
from restkv.bench.models import load_model  # noqa: E402
from restkv.compat import cache_argument  # noqa: E402
from restkv.config import CompressionConfig  # noqa: E402

# methods that evict while decoding, at their defaults: ReST-KV, the two made for long generations, the window
# attention (SnapKV), accumulated attention (H2O), the last query's (TOVA), recency (StreamingLLM), keys only
# (KeyDiff), the expected future attention (Expected Attention), a precomputed query direction (Q-Filters), the
# worst case over the window (DefensiveKV) and random eviction
METHODS = ["restkv", "rkv", "triattention", "snapkv", "h2o", "tova", "streamingllm", "keydiff",
           "expected_attention", "qfilter", "defensivekv", "random"]
# ReST-KV's knobs that act while decoding (its window: the queries observed and the entries always kept; the
# smoothing over the window's queries and over the cache's order; per-head budgets; refinement), and R-KV's
# and TriAttention's at ReST-KV's window of 32
VARIANTS = ["restkv_w8=restkv:window_size=8", "restkv_nopool=restkv:pooling=none", "restkv_paper=restkv:preset=paper",
            "restkv_adakv=restkv:head_budget=adakv", "restkv_refine2=restkv:refine_rounds=2,refine_pool=16",
            "rkv_w32=rkv:window_size=32", "triattention_w32=triattention:window_size=32"]
SETS = {"choice": dict(seed=1, held_out_from=None), "held_out": dict(seed=2, held_out_from=1)}


def grid(specs: list[str], budgets: list[int], intervals: list[int]) -> list[tuple[str, dict]]:
    """``(label, configure knobs)`` of every spec x budget x interval, labelled ``name|B|interval``, each
    validated (a ValueError naming the label)."""
    out = []
    for spec in specs:
        name, spec = named(spec)
        for budget in budgets:
            for interval in intervals:
                label = f"{name}|{budget}|{interval}"
                knobs = {**parse_method(spec), "max_capacity_prompt": budget, "decode_interval": interval}
                try:
                    CompressionConfig(**knobs)
                except ValueError as e:
                    raise ValueError(f"{label}: {e}") from None
                out.append((label, knobs))
    return out


@torch.no_grad()
def continuation(model, prompt: torch.Tensor, tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, desc: str | None = None) -> torch.Tensor:
    """[tokens] the full-cache model's continuation of ``prompt`` [L], end-of-sequence suppressed: greedy
    (``temperature`` 0), or sampled at ``temperature`` from the smallest set of tokens whose probability
    reaches ``top_p`` (transformers' top-p), with a generator seeded by ``seed``; ``desc``: a progress bar's."""
    restkv.detach(model)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    generator = torch.Generator().manual_seed(seed)
    out = model(prompt[None], use_cache=True)
    cache, ids = out.cache if getattr(out, "cache", None) is not None else out.past_key_values, []
    for _ in tqdm(range(tokens), desc=desc, unit="token", leave=False, disable=desc is None):
        logits = out.logits[0, -1].float().cpu()
        logits[eos] = float("-inf")
        ids.append(int(logits.argmax()) if temperature == 0 else _top_p_draw(logits / temperature, top_p, generator))
        out = model(torch.tensor([ids[-1:]]), use_cache=True, **{cache_argument(model): cache})
    return torch.tensor(ids)


def _top_p_draw(logits: torch.Tensor, top_p: float, generator) -> int:
    """A token drawn from softmax(``logits``) [V] restricted to the smallest most-probable set whose mass
    reaches ``top_p``."""
    probs, order = logits.softmax(-1).sort(descending=True)
    outside = probs.cumsum(-1) - probs >= top_p  # the mass before a token already reaches top_p
    probs = probs.masked_fill(outside, 0.0)
    return int(order[torch.multinomial(probs, 1, generator=generator)])


def _kl_top1(reference: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of log-probabilities ``reference`` [n, V] and ``logits`` [n, V]: KL(reference || softmax)
    and whether both put the same token first."""
    logp = logits.float().log_softmax(-1)
    kl = (reference.exp() * (reference - logp)).sum(-1)
    return kl, logp.argmax(-1) == reference.argmax(-1)


@torch.no_grad()
def evaluate(model, prompt: torch.Tensor, cont: torch.Tensor, configs: list[tuple[str, dict]], chunk: int,
             bin_size: int, desc: str | None = None) -> dict:
    """``{label: {"kl": [bins], "top1": [bins], "seconds": s}}``: each config's KL to the full cache and
    top-1 agreement at every continuation position (after each fed token), in bins of ``bin_size``; ``desc``:
    a progress bar's."""
    pre = restkv.sweep_caches(model, prompt[None], None, [{"method": "fullkv"}] + [k for _, k in configs])
    restkv.configure(model, method="fullkv")  # decoding reads each cache's own layers
    full, caches = pre.caches[0], pre.caches[1:]
    kl = torch.zeros(len(configs), cont.numel())
    top1 = torch.zeros(len(configs), cont.numel())
    seconds = [0.0] * len(configs)
    arg = cache_argument(model)
    for start in tqdm(range(0, cont.numel(), chunk), desc=desc, unit="chunk", leave=False, disable=desc is None):
        ids = cont[None, start: start + chunk]
        reference = model(ids, use_cache=True, **{arg: full}).logits[0].float().log_softmax(-1)
        for i, cache in enumerate(caches):
            t0 = time.process_time()
            logits = model(ids, use_cache=True, **{arg: cache}).logits[0]
            seconds[i] += time.process_time() - t0
            kl[i, start: start + ids.shape[1]], top1[i, start: start + ids.shape[1]] = _kl_top1(reference, logits)
    bins = math.ceil(cont.numel() / bin_size)
    return {label: {"kl": [float(kl[i, b * bin_size: (b + 1) * bin_size].mean()) for b in range(bins)],
                    "top1": [float(top1[i, b * bin_size: (b + 1) * bin_size].mean()) for b in range(bins)],
                    "seconds": seconds[i]}
            for i, (label, _) in enumerate(configs)}


@torch.no_grad()
def cost(model, prompt: torch.Tensor, cont: torch.Tensor, configs: list[tuple[str, dict]]) -> dict:
    """``{label: CPU seconds per generated token}`` of decoding ``cont`` one token at a time on each config's
    cache (``fullkv`` first), the configs taking turns token by token."""
    configs = [("fullkv", {"method": "fullkv"})] + configs
    pre = restkv.sweep_caches(model, prompt[None], None, [k for _, k in configs])
    restkv.configure(model, method="fullkv")
    seconds = [0.0] * len(configs)
    arg = cache_argument(model)
    for t in tqdm(cont.tolist(), desc="cost", unit="token", leave=False):
        for i, cache in enumerate(pre.caches):
            t0 = time.process_time()
            model(torch.tensor([[t]]), use_cache=True, **{arg: cache})
            seconds[i] += time.process_time() - t0
    return {label: s / cont.numel() for (label, _), s in zip(configs, seconds)}


def save(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def earlier_run(args) -> dict:
    """The record in ``args.output`` (``{}``: none); ``ValueError`` naming ``--output`` when it holds a run of
    other settings."""
    record = json.loads(Path(args.output).read_text()) if os.path.exists(args.output) else {}
    earlier = record.get("args") or record.get("cost_args")
    same = ("model_path", "set", "prompt", "tokens", "temperature", "top_p")
    if earlier and any(earlier[k] != getattr(args, k) for k in same):
        raise ValueError(f"--output {args.output} holds a run with other {', '.join(same)}")
    return record


def run(model, tokenizer, args, configs: list[tuple[str, dict]]) -> dict:
    """Every sample of ``args``' set into ``args.output`` (resumed), or the cost (``args.cost``)."""
    record = earlier_run(args)
    record["cost_args" if args.cost else "args"] = vars(args)
    prompts, starts = held_out_samples(tokenizer, args.samples, args.prompt, 0, reserve=32, **SETS[args.set])
    if len(starts) > len(record.get("starts", [])):  # a cost run (one sample) keeps the set's starts
        record["starts"] = starts
    conts, results = record.setdefault("continuations", []), record.setdefault("results", {})
    for i, prompt in enumerate(prompts):
        where = f"sample {i + 1}/{len(prompts)}"
        if len(conts) <= i:
            conts.append(continuation(model, prompt, args.tokens, args.temperature, args.top_p, starts[i],
                                      desc=f"{where}: continuation").tolist())
            save(args.output, record)
        cont = torch.tensor(conts[i])
        if args.cost:
            if "cost" not in record:
                record["cost"] = cost(model, prompt, cont[: args.cost_tokens], configs)
                save(args.output, record)
            return record
        todo = [(label, k) for label, k in configs if len(results.get(label, [])) <= i]
        if todo:
            for label, value in evaluate(model, prompt, cont, todo, args.chunk, args.bin,
                                         desc=f"{where}: {len(todo)} configs").items():
                results.setdefault(label, []).append(value)
            save(args.output, record)
        print(f"{where} done", file=sys.stderr, flush=True)
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_path", default="smollm2-135m")
    p.add_argument("--set", choices=tuple(SETS), default="choice")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=2048, help="generated tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: the greedy continuation; else sampled (R-KV and TriAttention evaluate at 0.6)")
    p.add_argument("--top_p", type=float, default=1.0, help="with --temperature: top-p (theirs: 0.95)")
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--intervals", type=int, nargs="+", default=[32, 128])
    p.add_argument("--chunk", type=int, default=None, help="tokens fed at a time (default: the intervals' gcd)")
    p.add_argument("--bin", type=int, default=128, help="positions per bin of the stored curves")
    p.add_argument("--methods", nargs="+", default=METHODS + VARIANTS, help="method or NAME=method:knob=value,...")
    p.add_argument("--cost", action="store_true", help="the cost per generated token instead (first sample)")
    p.add_argument("--cost_budget", type=int, default=256)
    p.add_argument("--cost_tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", required=True, help="the run's JSON file (resumed when it exists)")
    args = p.parse_args(argv)
    args.chunk = args.chunk or math.gcd(*args.intervals)
    if any(i % args.chunk for i in args.intervals):
        p.error(f"--chunk {args.chunk}: every interval must be a multiple of it")
    small = [f"--{k} {getattr(args, k)}" for k in ("samples", "prompt", "tokens", "bin", "threads", "cost_tokens")
             if getattr(args, k) < 1]
    if small:
        p.error(f"{small[0]}: must be >= 1")
    budgets = [args.cost_budget] if args.cost else args.budgets
    try:
        configs = grid(args.methods, budgets, args.intervals)
        earlier_run(args)
    except ValueError as err:
        p.error(str(err))
    print(plan_line(args, configs), file=sys.stderr, flush=True)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_path)
    try:
        run(model, tokenizer, args, configs)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished samples are in {args.output}; rerun the same command to resume",
              file=sys.stderr)
        raise SystemExit(130) from None
    print(f"results: {args.output}\ntabulate them with: python scripts/study/long_generation_table.py "
          f"{args.output}")


def plan_line(args, configs: list) -> str:
    """The run's size and output, printed before the model loads."""
    if args.cost:
        return (f"long generation, cost: {args.cost_tokens} tokens one at a time on the first sample, "
                f"{len(configs)} configs and the full cache -> {args.output}")
    return (f"long generation: {args.samples} samples ({args.set} set) of {args.prompt} prompt tokens, "
            f"{args.tokens} generated tokens each, {len(configs)} configs ({len(args.methods)} methods x "
            f"{len(args.budgets)} budgets x {len(args.intervals)} intervals) -> {args.output}")


if __name__ == "__main__":
    main()
