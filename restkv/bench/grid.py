"""The method x budget grid of a run: configs from the flags, validated, with labels that name their
non-default knobs; the knob metadata a rerun into the same folder must match.

Imports no torch itself: ``restkv`` is imported where a config is checked.
"""

import argparse
import dataclasses
import os
import re

from .cli import parse_methods, str2bool

# Knobs forwarded to ``restkv.configure`` only when given on the command line.
KNOBS = ("preset", "window_size", "kernel_size", "pooling", "use_wo", "use_norm", "use_ema", "alpha",
         "metric_mode", "scale", "tau", "use_pyramid", "beta", "merge", "gqa_agg", "sink_tokens",
         "head_budget", "floor", "normalize", "head_importance", "headkv_beta", "varlen",
         "quant_method", "nbits", "residual_length", "q_group_size")
QUANT_FIELDS = ("quant_method", "nbits", "residual_length", "q_group_size")


def method_configs(args):
    """Every method x budget of ``args``, then every ``--variant`` x budget, as ``(label, configure_kwargs)``,
    each validated.

    Labels are ``<method>_<budget>``, followed by ``-<knob>=<value>`` for every knob whose
    resolved value differs from that of ``method`` and ``budget`` alone (sorted by name), so
    runs with different knobs never share a label. ``fullkv`` appears once, labelled ``fullkv``,
    with no budget and no knobs. Only the knobs given on the command line are in the kwargs.
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
    import restkv

    variants = getattr(args, "variant", None) or []
    default = [] if variants else getattr(args, "default_methods", ["restkv"])
    methods = parse_methods(args.method if args.method is not None else default)
    unknown = [m for m in methods if m not in restkv.METHODS]
    if unknown:
        raise ValueError(f"method: unknown {unknown}; choose from {list(restkv.METHODS)}")
    budgets = list(dict.fromkeys(int(b) for b in args.max_capacity_prompts))
    if any(b < 1 for b in budgets):
        raise ValueError(f"max_capacity_prompts: budgets must be >= 1, got {budgets}")
    knobs = {k: getattr(args, k) for k in KNOBS if getattr(args, k, None) is not None}
    grid = [(m, {"method": m}, None) for m in methods]
    for name, text in variants:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.=+-]*", name):
            raise ValueError(f"variant {name!r}: the name must be a plain file name (letters, digits, _ . = + -)")
        try:
            grid.append((name, {"method": "restkv", **parse_knobs(text)}, name))
        except ValueError as err:
            raise ValueError(f"variant {name}: {err}") from None
    configs = []
    for stem, own, variant in grid:
        if own["method"] == "fullkv" and variant is None:
            configs.append(("fullkv", {"method": "fullkv"}))
            continue
        for budget in budgets:
            kwargs = {"max_capacity_prompt": budget, **knobs, **own}
            label = f"{stem}_{budget}"
            try:
                diff = knob_diff(kwargs)
            except ValueError as err:
                raise ValueError(f"variant {variant}: {label}: {err}" if variant else f"{label}: {err}") from None
            if variant is None:
                label += "".join(f"-{k}={_short(k, v)}" for k, v in diff.items())
            configs.append((label, kwargs))
    labels = [label for label, _ in configs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"variant: labels {repeated} repeat; give each variant its own name")
    return configs


def parse_knobs(text):
    """``"gqa_agg=sum_norm,use_ema=0"`` -> ``{"gqa_agg": "sum_norm", "use_ema": False}`` (types from the
    config's defaults; ``method`` and ``preset`` allowed too).

    Raises
    ------
    ValueError
        For an item that is not ``knob=value`` with a known knob, or a value of the wrong type.
    """
    from restkv import CompressionConfig

    defaults = {f.name: f.default for f in dataclasses.fields(CompressionConfig)}
    defaults.update(method="", preset="")
    knobs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in defaults or name == "max_capacity_prompt":
            raise ValueError(f"knob {item!r}: expected knob=value with a knob of CompressionConfig, method or preset")
        kind = type(defaults[name])
        try:
            knobs[name] = (str2bool(value) if kind is bool else kind(value) if kind in (int, float)
                           else None if value.lower() == "none" and defaults[name] is None else value)
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise ValueError(f"knob {item!r}: {err}") from None
    return knobs


def knob_diff(kwargs):
    """Validate ``kwargs`` and return the resolved knobs that differ from its method and budget alone.

    Raises
    ------
    ValueError
        ``restkv.CompressionConfig.from_kwargs``'s error, naming the field.
    """
    from restkv import CompressionConfig

    cfg = resolved_knobs(kwargs)
    # the method's own defaults (pooling, head_budget), with a budget and table any default accepts
    ref = dataclasses.asdict(CompressionConfig(method=cfg["method"], max_capacity_prompt=2**62, head_importance="-"))
    ref.update(max_capacity_prompt=cfg["max_capacity_prompt"], head_importance=None)
    return {k: v for k, v in sorted(cfg.items()) if v != ref[k]}


def _short(knob, value):
    """``value`` as it appears in a label (a head-importance file by its name)."""
    return os.path.splitext(os.path.basename(value))[0] if knob == "head_importance" else value


def quant_settings(kwargs):
    """The KV quantization of a config: ``None`` (full precision) or a dict of ``QUANT_FIELDS``."""
    from restkv import CompressionConfig

    cfg = CompressionConfig.from_kwargs(**kwargs)
    return {k: getattr(cfg, k) for k in QUANT_FIELDS} if cfg.quant_method else None


def configs_meta(configs):
    """Run metadata of ``method_configs``: per label its kwargs, non-default knobs, quantization and every
    knob's resolved value (what a rerun into the same folder must match)."""
    return {label: {"configure": kw, "knobs": knob_diff(kw), "quant": quant_settings(kw),
                    "resolved": resolved_knobs(kw)} for label, kw in configs}


def resolved_knobs(kwargs):
    """Every knob of ``kwargs`` as ``CompressionConfig`` resolves it (defaults filled in, validated)."""
    from restkv import CompressionConfig

    return dataclasses.asdict(CompressionConfig.from_kwargs(**kwargs))


def check_same_configs(path, previous, current):
    """Raise if a label of ``current`` (``configs_meta``) resolved to other knobs in ``previous`` (same folder):
    its records would mix two configs (e.g. after a default changed)."""
    for label, meta in current.items():
        old = (previous.get(label) or {}).get("resolved")
        if old is None:
            continue
        changed = {k: (old.get(k), v) for k, v in meta["resolved"].items() if old.get(k) != v}
        if changed:
            what = ", ".join(f"{k}={a!r} then, {b!r} now" for k, (a, b) in sorted(changed.items()))
            raise ValueError(f"{path}: results for {label} were made with other knobs ({what}); "
                             "rerunning into this folder would mix them: use another --save_dir")
