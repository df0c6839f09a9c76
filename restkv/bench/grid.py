"""The method x budget grid of a run: configs from the flags, validated, with labels that name their
non-default knobs; the knob metadata a rerun into the same folder must match.

A grid is a list of ``RunConfig``: each config resolved once, when the grid is built; the loop, sweep mode
and the run's metadata read that resolution. Imports no torch (``restkv.config`` needs none).
"""

import argparse
import math
import os
import re
import sys

from restkv import METHODS, PRESETS
from restkv.config import ALIASES, CompressionConfig, declared

from .cli import knob_flags, parse_methods, settings_suffix, str2bool

QUANT_FIELDS = ("quant_method", "nbits", "residual_length", "q_group_size")


class RunConfig(tuple):
    """One config of a grid: the pair ``(label, kwargs)`` (``restkv.configure``'s keyword knobs, as given),
    with ``cfg``, the ``CompressionConfig`` they resolve to, resolved once."""

    def __new__(cls, label: str, kwargs: dict, cfg: CompressionConfig | None = None):
        run = super().__new__(cls, (label, kwargs))
        run.cfg = CompressionConfig.from_kwargs(**kwargs) if cfg is None else cfg
        return run

    @property
    def label(self) -> str:
        return self[0]

    @property
    def kwargs(self) -> dict:
        return self[1]

    def relabel(self, label: str) -> "RunConfig":
        return RunConfig(label, self.kwargs, self.cfg)


def run_config(config) -> RunConfig:
    """``config`` as a ``RunConfig`` (a ``(label, kwargs)`` pair is resolved here)."""
    return config if isinstance(config, RunConfig) else RunConfig(*config)


def flag_knobs(args):
    """The knobs given on the command line (``--preset`` included): ``{name: value}``."""
    names = ["preset", *knob_flags()]
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def method_configs(args):
    """Every method x budget of ``args``, then every ``--variant`` x budget, as ``(label, configure_kwargs)``,
    each validated.

    Labels are ``<method>_<budget>``, followed by ``-<knob>=<value>`` for every knob whose
    resolved value differs from that of ``method`` and ``budget`` alone (sorted by name), then
    ``-attn_implementation=...`` / ``-dtype=...`` when those are not sdpa / float32, so
    runs with different knobs or backends never share a label. ``fullkv`` appears once, labelled ``fullkv``,
    with no budget and no knobs. A knob given on the command line reaches the configs whose method
    reads it (``--alpha`` reaches ReST-KV with an EMA, not SnapKV); one that no config reads is an error
    (with ``fullkv`` alone, as the original's scripts pass ``--window_size`` to it, a one-line note).
    Only the knobs given on the command line are in the kwargs.
    A variant ``NAME KNOBS`` is labelled ``NAME_<budget>``; its knobs override the command line's.
    Without ``--method`` the methods are ``args.default_methods`` (if set, else ``restkv``), or none when
    there are variants.

    Raises
    ------
    ValueError
        For a method that ``restkv.METHODS`` does not know, a budget < 1, a variant name that is not a
        plain file name or repeats a label, or a config that ``restkv.CompressionConfig.from_kwargs``
        rejects (the message names the label and the field).
    """
    variants = getattr(args, "variant", None) or []
    default = [] if variants else getattr(args, "default_methods", ["restkv"])
    methods = parse_methods(args.method if args.method is not None else default)
    unknown = [m for m in methods if m not in (*METHODS, "ablation")]
    if unknown:
        raise ValueError(f"method: unknown {unknown}; choose from {list(METHODS)}")
    sizes = budget_sizes(args)
    knobs = flag_knobs(args)
    grid = [(m, ablation_knobs(knobs) if m == "ablation" else {"method": m}, None) for m in methods]
    used = set(ABLATION_FLAGS) & set(knobs) if "ablation" in methods else set()
    for name, text in variants:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.=+-]*", name):
            raise ValueError(
                f"variant {name!r}: the name must be a plain file name (letters, digits, _ . = + -)"
            )
        try:
            grid.append((name, {"method": "restkv", **parse_knobs(text)}, name))
        except ValueError as err:
            raise ValueError(f"variant {name}: {err}") from None
    configs = []
    for stem, own, variant in grid:
        flags = (
            {k: v for k, v in knobs.items() if k not in ABLATION_FLAGS}
            if stem == "ablation"
            else knobs
        )
        if own["method"] == "fullkv" and variant is None:
            configs.append(RunConfig("fullkv", {"method": "fullkv"}))
            continue
        for size, budget in sizes:
            label = f"{stem}_{size}"
            try:
                reached = read_flags(flags, {**budget, **own})
                kwargs = {**budget, **reached, **own}
                run = RunConfig(label, kwargs)
                diff = resolved_diff(run.cfg)
            except ValueError as err:
                raise ValueError(
                    f"variant {variant}: {label}: {err}" if variant else f"{label}: {err}"
                ) from None
            used |= set(reached)
            if variant is None:
                label += "".join(f"-{k}={_short(k, v)}" for k, v in diff.items())
            configs.append(run.relabel(label))
    unread = sorted(set(knobs) - used)
    if unread and methods == ["fullkv"] and not variants:  # the original's scripts: "FullKV 128 32"
        flags = ", ".join(f"--{k}" for k in unread)
        print(f"fullkv: {flags} not read (no eviction); ignored", file=sys.stderr)
        unread = []
    if unread and configs:
        raise ValueError(
            f"--{unread[0]}: no config of this run reads it (methods {', '.join(methods) or '-'}); "
            f"--help lists which methods read which knobs"
        )
    suffix = settings_suffix(args)  # the backend and dtype, when not the defaults
    configs = [run.relabel(run.label + suffix) for run in configs]
    labels = [label for label, _ in configs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"variant: labels {repeated} repeat; give each variant its own name")
    return configs


def budget_sizes(args):
    """``[(label part, budget knob)]``: ``("128", {"max_capacity_prompt": 128})`` per budget, then
    ``("r0.1", {"max_capacity_prompt_ratio": 0.1})`` per ratio (the original's -1 budget is dropped beside ratios)."""
    ratios = list(dict.fromkeys(getattr(args, "max_capacity_prompts_ratio", None) or []))
    given = args.max_capacity_prompts
    budgets = list(
        dict.fromkeys(int(b) for b in (given if given is not None else [] if ratios else [128]))
    )
    if ratios:
        budgets = [b for b in budgets if b != -1]
    if any(b < 1 for b in budgets):
        raise ValueError(
            f"--max_capacity_prompts: each budget must be >= 1 and larger than window_size, got {budgets}"
        )
    if any(not 0 < r <= 1 for r in ratios):
        raise ValueError(f"--max_capacity_prompts_ratio: ratios must be in (0, 1], got {ratios}")
    return [(str(b), {"max_capacity_prompt": b}) for b in budgets] + [
        (f"r{r:g}", {"max_capacity_prompt_ratio": r}) for r in ratios
    ]


# The original's `--method ablation`: ReST-KV with its ablation's fixed values, and --indicator / --ts / --ss.
ABLATION = dict(
    method="restkv",
    kernel_size=5,
    alpha=0.3,
    scale=2000.0,
    use_wo=True,
    metric_mode="after",
    tau=1.0,
)
ABLATION_FLAGS = (
    "indicator",
    "ts",
    "temporal",
    "use_ema",
    "ss",
    "pooling",
)  # what the ablation config takes


def ablation_knobs(flags):
    """The knobs of the original's ``--method ablation`` under the command line's ``--indicator``, ``--ts``
    (``--temporal``) and ``--ss`` (``--pooling``); their defaults there: random, none, none.

    As the original: ``attn`` and ``attn-v`` sum the window's rows and average-pool with kernel 5 whatever
    ``--ts``/``--ss`` say; ``random`` keeps the window (the original draws among all positions).
    """
    indicator = flags.get("indicator", "random")
    own = {**ABLATION, "indicator": indicator}
    if indicator in ("attn", "attn-v"):
        own.update(temporal="mean", pooling="avgpool")
    else:
        ts = flags.get("ts", "none")
        temporal = {True: "ema", False: "mean"}.get(
            flags.get("use_ema"), {"none": "last"}.get(ts, ts)
        )
        own.update(
            temporal=flags.get("temporal", temporal),
            pooling=flags.get("pooling", flags.get("ss", "none")),
        )
    cfg = CompressionConfig.with_defaults(own, method="restkv")
    return {k: cfg[k] for k in own if k in cfg}


def parse_knobs(text):
    """``"gqa_agg=sum_norm,use_ema=0"`` -> ``{"gqa_agg": "sum_norm", "use_ema": False}`` (types from the
    config's defaults; ``method`` and ``preset`` allowed too).

    Raises
    ------
    ValueError
        For an item that is not ``knob=value`` with a known knob, or a value of the wrong type.
    """
    flags = knob_flags()
    knobs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in {*flags, "method", "preset"}:
            raise ValueError(
                f"knob {item!r}: expected knob=value with a knob of CompressionConfig, method or preset"
            )
        versions, alias = flags.get(name, ([], None))
        try:
            if alias is not None:
                knobs[name] = (
                    str2bool(value) if all(isinstance(v, bool) for v in alias[1]) else value
                )
            elif versions:
                knob = versions[0][1]
                kind = knob.kind
                knobs[name] = (
                    None
                    if (knob.nullable or knob.default is None) and value.lower() == "none"
                    else str2bool(value)
                    if kind is bool
                    else kind(value)
                )
            else:
                knobs[name] = value
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise ValueError(f"knob {item!r}: {err}") from None
    return knobs


def read_flags(flags, kwargs):
    """The command-line knobs ``flags`` that the config of ``kwargs`` reads (validated with it)."""
    cfg = CompressionConfig.with_defaults(flags, **kwargs)
    read = {k: v for k, v in flags.items() if k in cfg}
    if "preset" in flags and cfg.method == _preset_method(flags["preset"]):
        read["preset"] = flags["preset"]
    aliases = ALIASES
    read.update({k: v for k, v in flags.items() if k in aliases and aliases[k][0] in cfg})
    return read


def _preset_method(name):
    return PRESETS[name]["method"]


def knob_diff(kwargs):
    """Validate ``kwargs`` and return the resolved knobs that differ from its method and budget alone.

    Raises
    ------
    ValueError
        ``restkv.CompressionConfig.from_kwargs``'s error, naming the field.
    """
    return resolved_diff(CompressionConfig.from_kwargs(**kwargs))


def resolved_diff(cfg):
    """The knobs of a resolved config that differ from those of its method and budget alone."""
    knobs = declared(cfg["method"])  # the method's own defaults (pooling, head_budget, ...)
    return {
        k: v
        for k, v in sorted(cfg.items())
        if k not in ("method", "max_capacity_prompt", "max_capacity_prompt_ratio")
        and v != knobs[k].default
    }


def _short(knob, value):
    """``value`` as it appears in a label (a head-importance file by its name)."""
    return os.path.splitext(os.path.basename(value))[0] if knob == "head_importance" else value


def quant_settings(kwargs):
    """The KV quantization of a config: ``None`` (full precision) or a dict of ``QUANT_FIELDS``."""
    return quant_of(CompressionConfig.from_kwargs(**kwargs))


def quant_of(cfg):
    """The KV quantization of a resolved config (None: full precision)."""
    return {k: cfg[k] for k in QUANT_FIELDS} if cfg.get("quant_method") else None


def configs_meta(configs):
    """Run metadata of ``method_configs``: per label its kwargs, non-default knobs, quantization and every
    knob's resolved value (what a rerun into the same folder must match)."""
    runs = [run_config(c) for c in configs]
    return {
        run.label: {
            "configure": run.kwargs,
            "knobs": resolved_diff(run.cfg),
            "quant": quant_of(run.cfg),
            "resolved": run.cfg.as_dict(),
        }
        for run in runs
    }


def resolved_knobs(kwargs):
    """Every knob of ``kwargs`` as ``CompressionConfig`` resolves it (defaults filled in, validated)."""
    return CompressionConfig.from_kwargs(**kwargs).as_dict()


def check_same_configs(path, previous, current):
    """Raise if a label of ``current`` (``configs_meta``) resolved to other knobs in ``previous`` (same folder):
    its records would mix two configs (e.g. after a default changed)."""
    for label, meta in current.items():
        old = (previous.get(label) or {}).get("resolved")
        if old is None:
            continue
        changed = {k: (old[k], v) for k, v in meta["resolved"].items() if k in old and old[k] != v}
        if changed:
            what = ", ".join(f"{k}={a!r} then, {b!r} now" for k, (a, b) in sorted(changed.items()))
            raise ValueError(
                f"{path}: results for {label} were made with other knobs ({what}); "
                "rerunning into this folder would mix them: use another --save_dir"
            )


def announce(name, counts, configs, file=None):
    """Print the size of a run before any work (stderr): ``needle: 2 needles x 2 lengths x 3 depths x
    3 configs = 36 records``, then the config labels.

    ``counts`` is ``[(what, number)]``: the factors of the units of work; ``configs`` as :func:`method_configs`.
    Returns the number of records.
    """
    file = file or sys.stderr
    total = math.prod(n for _, n in counts) * len(configs)
    factors = " x ".join(f"{n} {what}" for what, n in [*counts, ("configs", len(configs))])
    print(f"{name}: {factors} = {total} records", file=file)
    print(f"{name}: configs {', '.join(label for label, _ in configs)}", file=file)
    overridden = preset_overrides(configs)
    if overridden:
        print(f"{name}: {overridden}", file=file)
    return total


def preset_overrides(configs) -> str:
    """One line naming, per config given a ``preset``, the knobs whose resolved value is not the
    preset's (``--preset paper --kernel_size 21``: ``kernel_size=21 (preset paper: 5) in
    restkv_1024-kernel_size=21``); ``""`` when every such config runs its preset's knobs."""
    found = {}
    for run in map(run_config, configs):
        preset = run.kwargs.get("preset")
        if preset is None:
            continue
        knobs = PRESETS[preset]
        diff = ", ".join(
            f"{k}={run.cfg[k]} (preset {preset}: {v})"
            for k, v in sorted(knobs.items())
            if k != "method" and k in run.cfg and run.cfg[k] != v
        )
        if diff:
            found.setdefault(diff, []).append(run.label)
    return "; ".join(
        f"not the preset's knobs: {diff} in {', '.join(labels)}" for diff, labels in found.items()
    )
