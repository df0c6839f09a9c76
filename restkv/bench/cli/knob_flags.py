"""One flag per declared knob and per alias, with help, type and choices read from the declarations."""

from .arg_types import add_switch, str2bool, typed


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
