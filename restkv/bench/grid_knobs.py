"""The knobs a grid's configs take besides their method: a variant's ``knob=value`` list, the original's
``--method ablation``, and which command-line knobs reach a config. Imports no torch."""

import argparse

from restkv import PRESETS
from restkv.config import ALIASES, CompressionConfig

from .cli import knob_flags, str2bool


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
