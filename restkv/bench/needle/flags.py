"""The needle sweep's flags: the needles, lengths and depths, the original's ``--s_len``/``--e_len``/``--step``."""

import os

from ..ranges import SYNTAX
from ...data.needles import NEEDLES, Needle

NEEDLE_LENGTHS = ["1024", "2048"]  # --context_lengths' default


def needles_from_args(args):
    """The needles of ``args``: the custom ``--needle``, else the ``--needles`` presets.

    Raises
    ------
    ValueError
        For a custom needle without its question or answer, or an unknown preset.
    """
    if args.needle:
        if not args.retrieval_question or not args.answer:
            raise ValueError("--needle needs --retrieval_question and --answer")
        return [Needle("custom", args.needle, args.retrieval_question, args.answer)]
    unknown = [n for n in args.needles if n not in NEEDLES]
    if unknown:
        raise ValueError(f"needles: unknown {unknown}; choose from {sorted(NEEDLES)}")
    return [NEEDLES[n] for n in args.needles]


def add_needle_args(parser):
    """Flags of the needle sweep (besides :func:`restkv.bench.cli.add_common_args`)."""
    g = parser.add_argument_group("needle in a haystack")
    g.add_argument(
        "--haystack_dir", default=None, help="folder of .txt files (default: the packaged essays)"
    )
    g.add_argument(
        "--needles",
        nargs="+",
        default=["passkey", "sf"],
        help="presets: passkey (a random 5-digit pass key) and sf (the San Francisco needle: "
        "'The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on "
        "a sunny day.')",
    )
    g.add_argument(
        "--needle", default=None, help="custom needle sentence ({key}: a random 5-digit number)"
    )
    g.add_argument("--retrieval_question", default=None, help="question of the custom needle")
    g.add_argument(
        "--answer", default=None, help="expected answer of the custom needle (may use {key})"
    )
    g.add_argument(
        "--context_lengths",
        nargs="+",
        default=list(NEEDLE_LENGTHS),
        help=f"prompt lengths in tokens (at most the model's context less --max_new_tokens): {SYNTAX}; "
        "e.g. 1024:4096:1024 = 1024 2048 3072 4096",
    )
    g.add_argument(
        "--depth_percents",
        nargs="+",
        default=["0:100:50"],
        help=f"needle depths in percent (0-100): {SYNTAX}; e.g. 0:100:25 = 0 25 50 75 100 = 0:100/5. "
        "The earlier start:stop:num form is an error when stop is off the step grid "
        "(0:100:11: write 0:100/11)",
    )
    g.add_argument(
        "-s",
        "--s_len",
        type=int,
        default=None,
        help="the original's shortest context length: with --e_len and --step, the lengths "
        "s_len, s_len + step, ... up to e_len (instead of --context_lengths)",
    )
    g.add_argument(
        "-e",
        "--e_len",
        type=int,
        default=None,
        help="the original's longest context length (see --s_len)",
    )
    g.add_argument(
        "--step",
        type=int,
        default=None,
        help="the original's length step (see --s_len; default 1000)",
    )
    g.add_argument(
        "--model_provider",
        default=None,
        help="the original's prompt family (LLaMA3, Mistral); restkv applies the model's own chat "
        "template (--chat_template), so this is only recorded in run_meta.json",
    )
    g.add_argument(
        "--model_version",
        default=None,
        help="the original's results folder name: results go to <save_dir>/<model_version>/ "
        "instead of <save_dir>/<model>/",
    )
    g.add_argument("--max_new_tokens", type=int, default=32)
    g.add_argument("--no_plots", action="store_true", help="skip the PNGs")
    parser.set_defaults(
        save_dir=os.path.join("results", "needle"), default_methods=["restkv", "snapkv", "fullkv"]
    )
    return parser


def original_lengths(args):
    """The original's ``--s_len``/``--e_len``/``--step`` lengths (``range(s_len, e_len + 1, step)``, as its
    ``np.arange``) and the flags named in errors, or ``(None, None)`` when they are not given.

    Raises
    ------
    ValueError
        Only one of ``--s_len``/``--e_len``, both with ``--context_lengths``, or a step < 1.
    """
    given = [f for f in ("s_len", "e_len") if getattr(args, f, None) is not None]
    if not given and getattr(args, "step", None) is None:
        return None, None
    if len(given) < 2:
        raise ValueError(
            "--s_len, --e_len and --step go together (the lengths s_len, s_len + step, ... e_len)"
        )
    step = args.step or 1000
    if step < 1:
        raise ValueError(f"--step must be >= 1, got {step}")
    if args.context_lengths != NEEDLE_LENGTHS:
        raise ValueError("--context_lengths: give either it or --s_len/--e_len/--step, not both")
    return list(range(args.s_len, args.e_len + 1, step)), "--e_len"
