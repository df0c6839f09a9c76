"""HeadKV's head importance of a model, from the command line (the computation: ``restkv.integration.headkv``).

python -m restkv.bench.head_scores --model_path smollm2-135m
"""

from __future__ import annotations

import json
import sys
import time

from ..integration.headkv import (  # noqa: F401 (the computation, re-exported)
    answer_attention, answer_scores, cached_head_importance, score_heads, table_path)
from ..integration.files import atomic_write
from .cli import ArgumentParser
from .models import load_model


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model_path", default="smollm2-135m", help="registry name, local checkpoint or hub id"
    )
    parser.add_argument(
        "--out", default=None, help="write the table here (default: the model's cache file)"
    )
    parser.add_argument(
        "--haystack_dir", default=None, help="folder of .txt files (default: the packaged essays)"
    )
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model_path)
    if args.out is None:
        path = cached_head_importance(model)
    else:
        t0 = time.time()
        table = score_heads(
            model,
            tokenizer,
            args.haystack_dir,
            log=lambda text: print(f"{text} ({time.time() - t0:.0f} s)", file=sys.stderr),
        )
        atomic_write(args.out, json.dumps(table))
        path = args.out
    print(path)
    return path


if __name__ == "__main__":
    main()
