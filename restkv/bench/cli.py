"""Command-line flags every runner shares, with the original ReST-KV names.

Imports no torch or transformers itself, so a runner can parse and check its arguments before the
heavy imports.
"""

import argparse

# ``--dtype`` choices: names of torch dtypes.
DTYPE_NAMES = ("bfloat16", "float16", "float32")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, its errors one line: ``prog: error: message (see --help)``, exit code 2 (argparse's
    own print the whole usage first: dozens of lines for a runner)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def startup(parser, prepare, args):
    """``prepare(args)``: a run's checks before any work. A ``ValueError`` or ``FileNotFoundError`` they raise
    (bad input, named by its flag or field) or a missing extra (``restkv.lazy.MissingExtra``) ends the program
    as ``parser.error`` does (one line, exit code 2); any other error keeps its traceback."""
    from restkv.lazy import MissingExtra

    try:
        return prepare(args)
    except (ValueError, FileNotFoundError, MissingExtra) as err:
        parser.error(str(err))


def results_dir(path: str) -> None:
    """Raise ``FileNotFoundError`` (naming ``--results_dir``) unless ``path`` is a folder with ``.jsonl`` results."""
    from pathlib import Path

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"--results_dir: {path} is not a folder")
    if next(root.rglob("*.jsonl"), None) is None:
        raise FileNotFoundError(f"--results_dir: no .jsonl predictions under {path}")


class Runner:
    """A runner script: its flags (the ``add`` functions), its checks before any work (``prepare(args) ->
    plan``, see :func:`startup`) and its work (``run(args, plan)``)."""

    def __init__(self, description, adders, prepare, run):
        self.description, self.adders, self.prepare, self.run = description, adders, prepare, run

    def build_parser(self):
        parser = ArgumentParser(description=self.description)
        for add in self.adders:
            add(parser)
        return parser

    def parse_args(self, argv=None):
        return self.build_parser().parse_args(argv)

    def main(self, argv=None):
        parser = self.build_parser()
        args = parser.parse_args(argv)
        return self.run(args, startup(parser, self.prepare, args))


def str2bool(text):
    """Parse ``1/0/true/false/yes/no`` (any case) into a bool for argparse."""
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "y", "on"):
        return True
    if value in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (1/0/true/false), got {text!r}")


def add_common_args(parser):
    """Add the flags every runner shares to ``parser`` and return it.

    Eviction knobs default to ``None`` and are then not forwarded, so the
    core's own defaults apply.
    """
    g = parser.add_argument_group("model and methods")
    g.add_argument("--method", nargs="+", default=None,
                   help="one or more methods (space or comma separated), e.g. restkv snapkv fullkv "
                        "(default: restkv, the needle runner restkv snapkv fullkv; none when only --variant is given)")
    g.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "KNOBS"),
                   help="an extra config per budget labelled NAME_<budget>, with KNOBS (knob=value,... over the "
                        "command line's knobs; method restkv unless given), e.g. restkv_paper preset=paper (repeatable)")
    g.add_argument("--model_path", default="smollm2-135m",
                   help="registry name (smollm2-135m, gemma3-270m), local path or hub id")
    g.add_argument("--max_capacity_prompts", nargs="+", type=int, default=None,
                   help="KV budgets per head and layer (window included); one run per budget (default: 128, or "
                        "none with --max_capacity_prompts_ratio)")
    g.add_argument("--max_capacity_prompts_ratio", nargs="+", type=float, default=None,
                   help="budgets as a fraction of each prompt instead: round(L * ratio) (window included); one run "
                        "per ratio, labelled <method>_r<ratio>")
    g.add_argument("--attn_implementation", default="sdpa")
    g.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    g.add_argument("--device", default="cpu")
    g.add_argument("--batch_size", type=int, default=1)
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--save_dir", default="results")
    g.add_argument("--chat_template", default="auto", choices=("auto", "on", "off"),
                   help="apply the model's chat template (auto: when it has one)")
    g.add_argument("--max_length", type=int, default=None,
                   help="prompt length cap in tokens (default: the model's max context)")
    g.add_argument("--no_sweep", action="store_true",
                   help="one prefill per config (configure + generate) instead of one shared prefill")
    g.add_argument("--query_agnostic", action="store_true",
                   help="compress each prompt's context (the prompt up to where its question starts) without its "
                        "question, then read the question and answer on the compressed cache "
                        "(restkv.compress_context): a context compressed once serves any question")
    g.add_argument("--device_map", default=None,
                   help="load with this device map (e.g. auto: layers spread over the GPUs, then CPU/disk)")
    g.add_argument("--offload_folder", default=None, help="folder of disk-offloaded weights (--device_map)")
    add_knob_args(parser)
    return parser


# Groups of the --help text, by where a knob is declared.
_GROUPS = (("general", "eviction knobs (unset: the core's defaults)"),
           ("budgets", "budgets of layers and heads (unset: the core's defaults)"),
           ("quant", "KV quantization of the kept entries (unset: full precision)"),
           ("method", "method knobs (each reaches the configs whose method reads it)"))
# The original's plural flag names, still accepted.
_PLURAL = {"window_size": "--window_sizes", "kernel_size": "--kernel_sizes"}


def _group(name):
    from restkv import config
    from restkv.strategies import budgets

    if name in {k.name for k in budgets.KNOBS}:
        return "budgets"
    if name in {k.name for k in config.GENERAL}:
        return "quant" if name != "window_size" else "general"
    if name in {k.name for k in config.EVICTION}:
        return "general"
    return "method"


def _parser_of(knob):
    """argparse ``type`` of a knob (``none`` is None for a knob that may be off)."""
    convert = str2bool if knob.kind is bool else knob.kind
    if not (knob.nullable or knob.default is None):
        return convert
    return lambda text: None if str(text).lower() == "none" else convert(text)


def knob_flags():
    """Every knob a runner takes as a flag (all declared knobs but the budget, then the aliases), by name:
    ``(knob versions [(owners, Knob)], alias target or None)``."""
    from restkv import config

    flags = {name: (versions, None) for name, versions in config.all_knobs().items()
             if name not in ("max_capacity_prompt", "max_capacity_prompt_ratio")}  # the runners take lists of them
    flags.update({alias: ([], target) for alias, target in config.ALIASES.items()})
    return flags


def add_knob_args(parser):
    """One flag per declared knob (help, type and choices from its declarations) and per alias, plus --preset.

    Every flag defaults to None: unset knobs are not forwarded, so each method's own defaults apply.
    """
    from restkv import PRESETS

    groups = {key: parser.add_argument_group(title) for key, title in _GROUPS}
    groups["general"].add_argument("--preset", choices=tuple(PRESETS),
                                   help="named knob set of one method; explicit knobs override it")
    for name, (versions, alias) in knob_flags().items():
        names = [f"--{name}"] + ([_PLURAL[name]] if name in _PLURAL else [])
        if alias is not None:
            target, mapping = alias
            kind = str2bool if all(isinstance(v, bool) for v in mapping) else str
            groups["method"].add_argument(*names, dest=name, type=kind,
                                          choices=None if kind is str2bool else tuple(mapping),
                                          help=f"the original's name of --{target}")
            continue
        knob = versions[0][1]
        choices = [c for _, k in versions for c in k.choices]
        readers = sorted({m for owners, _ in versions for m in owners})
        usual = max(versions, key=lambda v: len(v[0]))  # the default most methods have, then the others
        defaults = ", ".join([f"{usual[1].default}"] + [f"{'/'.join(o)}: {k.default}" for o, k in versions
                                                       if k.default != usual[1].default])
        cond = f"; when {knob.condition()}" if knob.when else ""
        who = "" if len(readers) > 8 else f"; read by {', '.join(readers)}"
        groups[_group(name)].add_argument(
            *names, dest=name, type=_parser_of(knob), choices=list(dict.fromkeys(choices)) or None,
            help=f"{knob.help} (default: {defaults}{who}{cond})".replace("%", "%%"))
    return parser


def parse_methods(values):
    """Flatten ``["restkv,snapkv", "fullkv"]`` into ``["restkv", "snapkv", "fullkv"]`` (order kept, no repeats)."""
    out = []
    for value in values:
        for name in str(value).split(","):
            name = name.strip().lower()
            if name and name not in out:
                out.append(name)
    return out


def check_common(args):
    """The checks of the shared flags that argparse does not make (``ValueError`` naming the flag)."""
    for flag in ("batch_size", "max_length", "max_new_tokens", "max_num_examples"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")


def add_dataset_args(parser):
    """Flags of the dataset runners (LongBench, InfiniteBench): example cap and generation-length override."""
    parser.add_argument("--max_num_examples", type=int, default=None,
                        help="first N records of each dataset only")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="override the official number of new tokens of every dataset")
    return parser
