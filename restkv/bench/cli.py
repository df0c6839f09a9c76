"""Command-line flags every runner shares, with the original ReST-KV names.

Imports no torch or transformers itself, so a runner can parse and check its arguments before the
heavy imports.
"""

import argparse
import sys

# ``--dtype`` choices: names of torch dtypes.
DTYPE_NAMES = ("bfloat16", "float16", "float32")
BACKENDS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# Run settings that change a record, with their defaults: one that differs is in every label.
SETTINGS = {"attn_implementation": "sdpa", "dtype": "float32"}


def typed(convert, name):
    """``convert`` (an argparse ``type``) marked with the type name that ``--help`` shows."""

    def parse(text):
        return convert(text)

    parse.type_name = name
    parse.__name__ = name  # argparse's "invalid float value: 'x'"
    return parse


def _type_name(action):
    kind = action.type
    if kind is None:
        return "text"
    named = getattr(kind, "type_name", None)
    return named or {int: "int", float: "float", str: "text"}.get(kind, "value")


# Example values for ``--help`` of flags without a default worth showing, by destination.
EXAMPLES = {
    "max_length": "4096",
    "offload_folder": "offload",
    "pruning_ratio": "0.5",
    "head_importance": "heads/Llama-3.1-8B-Instruct.json",
    "tokenizer": "meta-llama/Llama-3.1-8B-Instruct",
    "max_num_examples": "10",
    "max_new_tokens": "64",
    "datasets": "qasper hotpotqa",
    "tasks": "niah_single_1 vt",
    "num_samples": "20",
    "context_length": "4096",
    "haystack_dir": "data/PaulGrahamEssays",
    "needle": "'The secret code is {key}.'",
    "retrieval_question": "'What is the secret code?'",
    "answer": "'{key}'",
    "s_len": "1000",
    "e_len": "32001",
    "step": "200",
    "model_provider": "Mistral",
    "model_version": "Mistral_restkv_128",
    "variant": "restkv_paper preset=paper",
    "device_map": "auto",
    "chunk_size": "8",
}


def _example(action):
    """An example value of ``action``'s flag for ``--help`` (None: no example worth showing)."""
    if getattr(action, "example", None) is not None:
        return action.example
    if action.dest in EXAMPLES:
        return EXAMPLES[action.dest]
    if action.choices:
        return None  # listed by argparse already
    default = action.default
    if default is None or default is argparse.SUPPRESS or isinstance(default, bool):
        return None
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default)) or None
    return str(default)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows each flag's type (``--alpha FLOAT``), an example value, and switches as
    switches (``--use_wo``: on when given; a value, ``--use_wo false``, still accepted)."""

    def _get_default_metavar_for_optional(self, action):
        return _type_name(action).upper()

    def _format_args(self, action, default_metavar):
        if getattr(action, "switch", False):
            return "[true|false]"
        return super()._format_args(action, default_metavar)

    def _format_usage(self, usage, actions, groups, prefix):
        return super()._format_usage(usage, actions, groups, prefix).replace(" [true|false]", "")

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.nargs == 0:
            return text
        if getattr(action, "switch", False):
            flag = action.option_strings[0]
            return f"{text} [switch: {flag} turns it on, {flag} false off]".strip()
        if action.choices:
            return text
        example = _example(action)
        kind = _type_name(action)
        flag = next(f for f in action.option_strings if f.startswith("--"))
        tail = f"{kind}, e.g. {flag} {example}" if example is not None else kind
        return f"{text} [{tail}]".strip()


def add_switch(group, *names, help="", **kwargs):
    """A boolean flag as the original's switches: ``--use_wo`` sets it, ``--use_wo false``
    (1/0/true/false) still gives a value. Returns the action."""
    action = group.add_argument(*names, nargs="?", const=True, type=str2bool, help=help, **kwargs)
    action.switch = True
    return action


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, its errors one line: ``prog: error: message (see --help)``, exit code 2 (argparse's
    own print the whole usage first: dozens of lines for a runner); ``--help`` by
    :class:`HelpFormatter`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

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


# How each benchmark's results are tabulated ({path}: its results folder; needles: its results file).
TABULATE = {
    "needle": "python -m restkv.bench.needle.report {path}",
    "ruler": "python eval_ruler.py --results_dir {path}",
    "longbench": "python eval.py --results_dir {path}",
    "longbench_e": "python eval.py --e --results_dir {path}",
    "infinite_bench": "python eval_infinite.py --results_dir {path}",
    "math": "python eval_math.py --results_dir {path}",
    "longbench_v2": "python eval_longbench_v2.py --results_dir {path}",
    "scbench": "python eval_scbench.py --results_dir {path}",
}


def other_results(root, wanted):
    """``"; <folder> holds needle results: tabulate them with ..."`` when runs under ``root`` (their
    ``run_meta.json``) are of another benchmark than ``wanted``, else ``""``."""
    import json
    from pathlib import Path

    hints = []
    for meta in sorted(Path(root).rglob("run_meta.json")):
        try:
            benchmark = json.loads(meta.read_text(encoding="utf-8")).get("benchmark")
        except (OSError, ValueError):
            continue
        if benchmark in TABULATE and benchmark != wanted:
            where = meta.parent / "results.jsonl" if benchmark == "needle" else meta.parent
            hints.append(
                f"{meta.parent} holds {benchmark} results: tabulate them with "
                + TABULATE[benchmark].format(path=where)
            )
    return "; " + "; ".join(hints) if hints else ""


class Runner:
    """A runner script: its flags (the ``add`` functions), its checks before any work (``prepare(args) ->
    plan``, see :func:`startup`) and its work (``run(args, plan)``)."""

    def __init__(self, description, adders, prepare, run):
        self.description = description
        self.adders = adders
        self.prepare = prepare
        self.run = run

    def build_parser(self):
        parser = ArgumentParser(description=self.description)
        for add in self.adders:
            add(parser)
        return parser

    def parse_args(self, argv=None):
        return self.build_parser().parse_args(argv)

    def main(self, argv=None):
        """Parse, check (:func:`startup`) and run. Ctrl-C ends the run with one line and exit code 130:
        every finished record is on disk (each is written as it is made), so the same command resumes."""
        parser = self.build_parser()
        args = parser.parse_args(argv)
        try:
            return self.run(args, startup(parser, self.prepare, args))
        except KeyboardInterrupt:
            print("\ninterrupted: rerun the same command to resume", file=sys.stderr)
            raise SystemExit(130) from None


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
    g.add_argument(
        "--method",
        nargs="+",
        default=None,
        metavar="METHOD",
        help="one or more methods (space or comma separated), e.g. restkv snapkv fullkv "
        "(default: restkv, the needle runner restkv snapkv fullkv; none when only --variant is given)",
    )
    g.add_argument(
        "--variant",
        nargs=2,
        action="append",
        metavar=("NAME", "KNOBS"),
        help="an extra config per budget labelled NAME_<budget>, with KNOBS (knob=value,... over the "
        "command line's knobs; method restkv unless given), e.g. restkv_paper preset=paper (repeatable)",
    )
    model = g.add_argument(
        "--model_path",
        "--model_name",
        default="smollm2-135m",
        help="registry name (smollm2-135m, gemma3-270m), local path or hub id "
        "(--model_name: the original needle runner's name)",
    )
    model.example = "meta-llama/Llama-3.1-8B-Instruct"
    budgets = g.add_argument(
        "--max_capacity_prompts",
        "--max_capacity_prompt",
        nargs="+",
        type=int,
        help="KV budgets per head and layer (window included); one run per "
        "budget (default: 128, or none with --max_capacity_prompts_ratio)",
    )
    budgets.example = "128 512"
    ratios = g.add_argument(
        "--max_capacity_prompts_ratio",
        nargs="+",
        type=float,
        help="budgets as a fraction of each prompt instead: round(L * ratio) "
        "(window included); one run per ratio, labelled <method>_r<ratio>",
    )
    ratios.example = "0.1 0.2"
    g.add_argument(
        "--attn_implementation",
        default=SETTINGS["attn_implementation"],
        choices=BACKENDS,
        help="attention backend (flash_attention_2: CUDA and the flash-attn package, "
        "pip install -e '.[flash]'); not sdpa: in each label",
    )
    g.add_argument(
        "--dtype",
        default=SETTINGS["dtype"],
        choices=DTYPE_NAMES,
        help="model weights and activations; not float32: in each label",
    )
    g.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda, cuda:N, or auto (cuda when there is one, else cpu with a note)",
    )
    g.add_argument(
        "--batch_size", "--eval_batch_size", type=int, default=1, help="prompts per forward"
    )
    g.add_argument("--seed", type=int, default=42)
    threads = g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of torch's operators (torch.set_num_threads; default: torch's own, one per core): "
        "1 on a machine other jobs share is often several times faster; scores do not change",
    )
    threads.example = "1"
    g.add_argument(
        "--save_dir", default="results", help="results folder (records of other settings never mix)"
    )
    add_switch(
        g,
        "--use_cache",
        default=True,
        help="the original's flag: decoding always runs on the (evicted) KV cache; only "
        "true is accepted",
    )
    g.add_argument(
        "--chat_template",
        default="auto",
        choices=("auto", "on", "off"),
        help="apply the model's chat template (auto: when it has one)",
    )
    g.add_argument(
        "--max_length",
        type=int,
        default=None,
        help="prompt length cap in tokens (default: the model's max context)",
    )
    g.add_argument(
        "--no_sweep",
        action="store_true",
        help="one prefill per config (configure + generate) instead of one shared prefill",
    )
    g.add_argument(
        "--query_agnostic",
        action="store_true",
        help="compress each prompt's context (the prompt up to where its question starts) without its "
        "question, then read the question and answer on the compressed cache "
        "(restkv.compress_context): a context compressed once serves any question",
    )
    g.add_argument(
        "--device_map",
        default=None,
        help="load with this device map (e.g. auto: layers spread over the GPUs, then CPU/disk)",
    )
    g.add_argument(
        "--offload_folder", default=None, help="folder of disk-offloaded weights (--device_map)"
    )
    add_knob_args(parser)
    return parser


# Groups of the --help text, by where a knob is declared.
_GROUPS = (
    ("general", "eviction knobs (unset: the core's defaults)"),
    ("budgets", "budgets of layers and heads (unset: the core's defaults)"),
    ("quant", "KV quantization of the kept entries (unset: full precision)"),
    ("method", "method knobs (each reaches the configs whose method reads it)"),
)
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
    name = {bool: "bool", str: "text"}.get(knob.kind, knob.kind.__name__)
    if not (knob.nullable or knob.default is None):
        return typed(convert, name)

    def maybe(text):
        return None if str(text).lower() == "none" else convert(text)

    return typed(maybe, f"{name}|none")


def _knob_example(versions):
    """An example value of a knob flag: its first non-None default (``str`` paths: none)."""
    for _, knob in versions:
        if knob.default is not None and not isinstance(knob.default, bool):
            return f"{knob.default:g}" if isinstance(knob.default, float) else str(knob.default)
    return None


def knob_flags():
    """Every knob a runner takes as a flag (all declared knobs but the budget, then the aliases), by name:
    ``(knob versions [(owners, Knob)], alias target or None)``."""
    from restkv import config

    flags = {
        name: (versions, None)
        for name, versions in config.all_knobs().items()
        if name not in ("max_capacity_prompt", "max_capacity_prompt_ratio")
    }  # the runners take lists of them
    flags.update({alias: ([], target) for alias, target in config.ALIASES.items()})
    return flags


def add_knob_args(parser):
    """One flag per declared knob (help, type and choices from its declarations) and per alias, plus --preset.

    Every flag defaults to None: unset knobs are not forwarded, so each method's own defaults apply.
    """
    from restkv import PRESETS

    groups = {key: parser.add_argument_group(title) for key, title in _GROUPS}
    groups["general"].add_argument(
        "--preset",
        choices=tuple(PRESETS),
        help="named knob set of one method; explicit knobs override it",
    )
    for name, (versions, alias) in knob_flags().items():
        names = [f"--{name}"] + ([_PLURAL[name]] if name in _PLURAL else [])
        if alias is not None:
            target, mapping = alias
            if all(isinstance(v, bool) for v in mapping):
                text = (
                    f"the original's name of --{target} {mapping[True]} (false: {mapping[False]})"
                )
                add_switch(groups["method"], *names, dest=name, help=text)
            else:
                groups["method"].add_argument(
                    *names,
                    dest=name,
                    choices=tuple(mapping),
                    help=f"the original's name of --{target}",
                )
            continue
        knob = versions[0][1]
        choices = [c for _, k in versions for c in k.choices]
        readers = sorted({m for owners, _ in versions for m in owners})
        usual = max(
            versions, key=lambda v: len(v[0])
        )  # the default most methods have, then the others
        defaults = ", ".join(
            [f"{usual[1].default}"]
            + [f"{'/'.join(o)}: {k.default}" for o, k in versions if k.default != usual[1].default]
        )
        cond = f"; when {knob.condition()}" if knob.when else ""
        who = "" if len(readers) > 8 else f"; read by {', '.join(readers)}"
        text = f"{knob.help} (default: {defaults}{who}{cond})".replace("%", "%%")
        if knob.kind is bool and not knob.nullable:
            add_switch(groups[_group(name)], *names, dest=name, help=text)
            continue
        action = groups[_group(name)].add_argument(
            *names,
            dest=name,
            type=_parser_of(knob),
            choices=list(dict.fromkeys(choices)) or None,
            help=text,
        )
        action.example = None if choices else _knob_example(versions)
    return parser


# The original's other method names.
METHOD_ALIASES = {"full": "fullkv"}


def parse_methods(values):
    """Flatten ``["restkv,snapkv", "fullkv"]`` into ``["restkv", "snapkv", "fullkv"]`` (order kept, no
    repeats; any case, and the original's ``full`` for ``fullkv``)."""
    out = []
    for value in values:
        for name in str(value).split(","):
            name = name.strip().lower()
            name = METHOD_ALIASES.get(name, name)
            if name and name not in out:
                out.append(name)
    return out


def check_common(args):
    """The checks of the shared flags that argparse does not make (``ValueError`` naming the flag)."""
    for flag in ("batch_size", "max_length", "max_new_tokens", "max_num_examples", "threads"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    if getattr(args, "use_cache", True) is False:
        raise ValueError(
            "--use_cache: restkv always decodes on the KV cache (the one it evicts); "
            "only --use_cache (true) is accepted"
        )
    if getattr(args, "save_dir", None):
        check_save_dir(args)


def check_save_dir(args):
    """Raise ``ValueError`` naming ``--save_dir`` when the run's folder (``<save_dir>/<model>``, or
    ``<model_version>``) cannot be made: it, ``--save_dir`` or a folder above is a file, or the
    nearest existing folder is not writable."""
    import os
    from pathlib import Path

    from .models import model_name

    given = Path(os.path.abspath(args.save_dir))
    name = getattr(args, "model_version", None) or model_name(args.model_path)
    out = given / name
    for folder in (out, *out.parents):
        if not folder.exists():
            continue
        if folder == out and not folder.is_dir():
            raise ValueError(f"--save_dir: {out} (the run's folder) is a file; give another one")
        if folder == given and not folder.is_dir():
            raise ValueError(f"--save_dir: {args.save_dir} is a file, not a folder")
        if not folder.is_dir():
            raise ValueError(f"--save_dir: {args.save_dir} lies under {folder}, a file")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"--save_dir: {args.save_dir}: {folder} is not writable")
        return


def add_dataset_args(parser):
    """Flags of the dataset runners (LongBench, InfiniteBench): example cap and generation-length override."""
    parser.add_argument(
        "--max_num_examples", type=int, default=None, help="first N records of each dataset only"
    )
    parser.add_argument(
        "--max_new_tokens",
        type=int,
        default=None,
        help="override the official number of new tokens of every dataset",
    )
    return parser


def add_tasks_arg(parser, tasks, note: str = ""):
    """``--tasks``: a subset of a benchmark's ``tasks`` (default: all), ``note`` appended to its help."""
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=tasks,
        choices=tasks,
        metavar="TASK",
        help=f"tasks to run (default: all {len(tasks)}): {' '.join(tasks)}{note}",
    )


# The package each flash-attention backend needs.
FLASH_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn 3"),
}


def check_backend(args, file=None):
    """Resolve ``--device auto``; refuse a device or backend this machine cannot run, before any work.

    Raises
    ------
    ValueError
        One line naming the flag and what to do instead: ``--device cuda`` without a CUDA device,
        ``--attn_implementation flash_attention_2`` without flash-attn (the ``.[flash]`` extra) or off
        CUDA.
    """
    import importlib.util
    import os

    from restkv.lazy import torch

    device = str(args.device)
    backend = args.attn_implementation
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            print("--device auto: no CUDA device here, running on CPU", file=file or sys.stderr)
        args.device = device
    if device.startswith("cuda") and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ValueError(
            f"--device {device}: no CUDA device here{shown}; use --device cpu (or auto)"
        )
    if backend in FLASH_PACKAGES:
        module, package = FLASH_PACKAGES[backend]
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"--attn_implementation {backend}: {package} is not installed; install "
                "restkv's flash extra (pip install -e '.[flash]', on a CUDA machine) or use "
                "--attn_implementation sdpa"
            )
        on_cuda = device.startswith("cuda") or getattr(args, "device_map", None)
        if not on_cuda:
            raise ValueError(
                f"--attn_implementation {backend} runs on CUDA only "
                f"(--device {device}); "
                "add --device cuda, or use --attn_implementation sdpa"
            )


def run_settings(args):
    """The run settings of ``args`` that change a record (:data:`SETTINGS`): ``{name: value}``."""
    return {name: getattr(args, name, default) for name, default in SETTINGS.items()}


def settings_suffix(args):
    """Label suffix of the settings that differ from their defaults (``-attn_implementation=eager``)."""
    return "".join(f"-{k}={v}" for k, v in run_settings(args).items() if v != SETTINGS[k])


def prompt_settings(args):
    """The settings besides the labels' that change a record of a run with one file per label (what a
    rerun into the same folder must match): chat template, prompt cap, new tokens, template set, questions
    per context."""
    names = ("chat_template", "max_length", "max_new_tokens", "template", "context_length", "max_turns")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
