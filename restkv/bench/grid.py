"""The method x budget grid of a run: configs from the flags, validated, with labels that name their
non-default knobs; the knob metadata a rerun into the same folder must match.

A grid is a list of ``RunConfig``: each config resolved once, when the grid is built; the loop, sweep mode
and the run's metadata read that resolution. Imports no torch (``restkv.config`` needs none). The knobs from
text and the original's ablation are in ``grid_knobs``, what the configs resolve to in ``grid_resolved``.
"""

import math
import os
import re
import sys

from restkv import METHODS, PRESETS
from restkv.config import CompressionConfig
from restkv.methods import unknown_method

from .cli import knob_flags, parse_methods, settings_suffix
from .grid_knobs import ABLATION, ABLATION_FLAGS, ablation_knobs, parse_knobs, read_flags  # noqa: F401
from .grid_resolved import (  # noqa: F401  (read from here too)
    QUANT_FIELDS,
    check_same_configs,
    knob_diff,
    quant_of,
    quant_settings,
    resolved_diff,
    resolved_knobs,
)


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
        raise ValueError(f"method: {'; '.join(map(unknown_method, unknown))}")
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


def _short(knob, value):
    """``value`` as it appears in a label (a head-importance file by its name)."""
    return os.path.splitext(os.path.basename(value))[0] if knob == "head_importance" else value


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
