"""One validated config of an eviction run, resolved from the knob declarations.

The knobs a config holds are exactly those its method and strategies read: the general ones below,
the strategies' (``restkv.strategies.STRATEGIES``: budgets, merging, ranking, decoding) and the method's own
(``methods/<name>.py``), each only when its ``when`` condition holds. Knob names follow the original ReST-KV
command line, so sweep scripts carry over.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping

from .knobs import Knob
from .methods import METHODS, REGISTRY
from .strategies import STRATEGIES, think

QUANT_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
QUANT_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
_QUANTIZED = {"quant_method": tuple(QUANT_BITS)}

# Read by every run (fullkv ignores the budget and window).
GENERAL = (
    Knob(
        "max_capacity_prompt",
        512,
        "entries kept per KV head per layer after prefill (the budget B), window included",
        check=lambda b: b >= 1,
        rule=">= 1 and larger than window_size",
        when={"max_capacity_prompt_ratio": (None,)},
    ),
    Knob(
        "max_capacity_prompt_ratio",
        None,
        "the budget as a fraction of each sample's prompt instead: "
        "round(L * ratio) entries (window included, at least window_size + 1)",
        check=lambda r: 0 < r <= 1,
        rule="in (0, 1]",
        nullable=True,
        of=float,
    ),
    Knob(
        "window_size",
        32,
        "the last prompt tokens: always kept, and their queries observe the prefix",
        check=lambda w: w >= 1,
        rule=">= 1",
    ),
    Knob(
        "quant_method",
        None,
        "hold the kept entries in transformers' quantized cache layer: quanto (2/4 "
        "bits) or hqq (1/2/3/4/8 bits); none: full precision",
        choices=tuple(QUANT_BITS),
        nullable=True,
    ),
    Knob("nbits", 4, "bits per quantized key/value element", when=_QUANTIZED),
    Knob(
        "residual_length",
        32,
        "decoded entries kept in full precision before they are quantized in one go",
        check=lambda n: n >= 0,
        rule=">= 0",
        when=_QUANTIZED,
    ),
    Knob(
        "q_group_size",
        64,
        "quantization group size",
        check=lambda n: n >= 1,
        rule=">= 1",
        when=_QUANTIZED,
    ),
) + think.KNOBS
# read by every method that evicts
EVICTION = tuple(knob for strategy in STRATEGIES for knob in strategy.KNOBS)
# Other names of a knob (the original's flags): name -> (knob, {value: knob's value}).
ALIASES = {"ss": ("pooling", {p: p for p in ("none", "avgpool", "maxpool", "adaptive")})}
for _part in (*STRATEGIES, *(m.module for m in REGISTRY.values())):
    ALIASES.update(getattr(_part, "ALIASES", {}))

# Named knob sets. "paper": ReST-KV exactly as published (ICLR 2026 paper and its code).
PRESETS = {
    "paper": dict(
        method="restkv",
        indicator="reconstruction",
        window_size=32,
        kernel_size=5,
        pooling="adaptive",
        scale=2000.0,
        temporal="ema",
        alpha=0.3,
        metric_mode="after",
        use_wo=True,
        tau=1.0,
    ),
}


def declared(method: str) -> dict:
    """Every knob ``method`` may read, by name (with the registry's defaults)."""
    m = REGISTRY[method]
    knobs = GENERAL + (EVICTION + m.knobs if m.evicts else ())
    out = {k.name: k for k in knobs}
    for name, value in m.defaults.items():
        out[name] = out[name].but(default=value)
    return out


def all_knobs() -> dict:
    """Every declared knob by name -> list of ``(owners, Knob)`` (owners: the methods that read that version)."""
    out: dict = {}
    for method in METHODS:
        for knob in declared(method).values():
            versions = out.setdefault(knob.name, [])
            for owners, k in versions:
                if k == knob:
                    owners.append(method)
                    break
            else:
                versions.append(([method], knob))
    return out


@functools.lru_cache(maxsize=None)
def _known() -> frozenset:
    return frozenset(all_knobs()) | frozenset(ALIASES) | {"method"}


class Knobs(Mapping):
    """Resolved knob values with attribute access; reading a knob that is not there raises."""

    __slots__ = ("_values",)

    def __init__(self, values: dict):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name):
        if name.startswith("__") or name == "_values":
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(
                f"{name} is not read by this config (its knobs: {', '.join(self._values)})"
            ) from None

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __getitem__(self, name):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __hash__(self):
        return hash(tuple(sorted(self._values.items(), key=lambda kv: kv[0])))

    def __eq__(self, other):
        return (
            isinstance(other, Knobs) and type(self) is type(other) and self._values == other._values
        )

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def __reduce__(self):
        return (_rebuild, (type(self), self._values))

    def as_dict(self) -> dict:
        return dict(self._values)


def _rebuild(cls, values):
    obj = object.__new__(cls)
    object.__setattr__(obj, "_values", dict(values))
    return obj


class CompressionConfig(Knobs):
    """Every knob of one eviction run, validated: ``CompressionConfig(preset=None, **knobs)``.

    ``method`` is one of ``METHODS`` (``"fullkv"`` keeps the whole cache; default ``"restkv"``); the
    other knobs are those the method and its strategies declare (``restkv.knob_table()`` lists them).
    A knob that no declaration has, or that the chosen method does not read (also one that is read
    only under a condition that does not hold, e.g. ``alpha`` without ``use_ema=True``), raises a
    ``ValueError`` naming it. A preset's knobs that the method does not read are dropped.
    """

    __slots__ = ()

    def __init__(self, preset: str | None = None, **kwargs):
        object.__setattr__(self, "_values", resolve(preset, kwargs))

    @classmethod
    def from_kwargs(cls, preset: str | None = None, **kwargs) -> "CompressionConfig":
        """Build from keyword knobs (over a named ``preset``); a bad knob raises a ValueError naming it."""
        return cls(preset=preset, **kwargs)

    @classmethod
    def with_defaults(cls, defaults: dict, **kwargs) -> "CompressionConfig":
        """Like ``from_kwargs``, over ``defaults`` that apply where the config reads them (as a preset's do);
        a runner's command-line knobs reach each config of its grid this way."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "_values", resolve(kwargs.pop("preset", None), kwargs, defaults))
        return obj

    @property
    def evicts(self) -> bool:
        """Whether the method evicts (``fullkv`` keeps every entry)."""
        return REGISTRY[self.method].evicts

    @property
    def pyramid(self) -> bool:
        """Whether the layers' budgets follow PyramidKV's pyramid (``layer_budget="pyramid"``)."""
        return self.get("layer_budget") == "pyramid"

    @property
    def scorer(self):
        """The registry's ``Method`` of this config."""
        return REGISTRY[self.method]

    def score_knobs(self) -> Knobs:
        """The knobs the score reads (its cfg): the method's knobs of the ``score`` stage that are read."""
        names = [k.name for k in self.scorer.knobs if k.stage == "score"]
        return Knobs({k: self[k] for k in names if k in self})


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def _unalias(kwargs: dict) -> tuple[dict, dict]:
    """Knobs with every alias replaced by its knob, and {knob: the alias it was given as}."""
    out = dict(kwargs)
    given_as = {}
    for old, (new, mapping) in ALIASES.items():
        if old in out:
            if new in out:
                raise ValueError(
                    f"{old} and {new} are one knob ({old} is its other name); give one of them"
                )
            value = out.pop(old)
            if value not in mapping:
                raise ValueError(
                    f"{old} must be one of {', '.join(map(str, mapping))}; got {value!r}"
                )
            out[new] = mapping[value]
            given_as[new] = old
    return out, given_as


def _unknown(name: str) -> str:
    """``unknown knob NAME`` with the nearest known names (``; did you mean max_capacity_prompt?``)."""
    import difflib

    close = difflib.get_close_matches(name, sorted(_known()), n=3, cutoff=0.75)
    return f"unknown knob {name}" + (f"; did you mean {' or '.join(close)}?" if close else "")


def resolve(preset: str | None, kwargs: dict, defaults: dict | None = None) -> dict:
    """The validated values of every knob a config reads (see ``CompressionConfig``).

    ``defaults`` (over the preset, under ``kwargs``) apply only where the config reads them.
    """
    defaults, (given, given_as) = _unalias(defaults or {})[0], _unalias(kwargs)
    default_preset = defaults.pop("preset", None)
    preset = given.pop("preset", None) if preset is None else preset
    unknown = sorted(set(given) - _known()) + sorted(set(defaults) - _known())
    if unknown:
        raise ValueError(f"{'; '.join(map(_unknown, unknown))} (restkv.knob_table() lists every knob)")
    for name in filter(None, (preset, default_preset)):
        _check_choice("preset", name, tuple(PRESETS))
    method = given.get(
        "method", PRESETS[preset]["method"] if preset else defaults.get("method", "restkv")
    )
    if preset and PRESETS[preset]["method"] != method:
        raise ValueError(
            f"preset {preset!r} holds {PRESETS[preset]['method']}'s knobs; method is {method}"
        )
    if default_preset and PRESETS[default_preset]["method"] == method and not preset:
        preset = default_preset  # a runner's --preset reaches the configs of its method only
    base = {**(_unalias(PRESETS[preset])[0] if preset else {}), **defaults}
    _check_choice("method", method, METHODS)
    knobs = declared(method)

    def called(name):
        return f"{given_as[name]} ({name})" if name in given_as else name

    for name in given:
        if name != "method" and name not in knobs:
            raise ValueError(
                f"{called(name)} is not a knob of method {method} (its knobs: {', '.join(knobs)})"
            )
    values = {name: knob.default for name, knob in knobs.items()}
    values.update({k: v for k, v in base.items() if k in knobs})
    values.update({k: v for k, v in given.items() if k != "method"})
    for name in values:
        values[name] = knobs[name].validate(values[name])
    read = set(knobs)
    while True:  # knobs read under conditions on other knobs that are read
        now = {name for name in read if knobs[name].read_when({k: values[k] for k in read})}
        if now == read:
            break
        read = now
    current = {k: values[k] for k in read}
    for name in given:
        if name in knobs and name not in read:
            raise ValueError(
                f"{called(name)} is read by method {method} only when {knobs[name].condition(current)}"
            )
    values = {"method": method, **{k: values[k] for k in knobs if k in read}}
    if REGISTRY[method].evicts:
        _check_general(values)
        for part in STRATEGIES:
            getattr(part, "check", _no_check)(values)
        REGISTRY[method].check(values)
    _check_quant(values)
    return values


def _no_check(values: dict) -> None:
    return None


def _check_general(values: dict) -> None:
    if "max_capacity_prompt" in values and values["window_size"] >= values["max_capacity_prompt"]:
        raise ValueError(
            f"window_size ({values['window_size']}) must be smaller than max_capacity_prompt "
            f"({values['max_capacity_prompt']}): the budget holds the window and at least one more entry"
        )


def _check_quant(values: dict) -> None:
    method = values.get("quant_method")
    if method is None:
        return
    if values.get("pruning_ratio") is not None:
        raise ValueError(
            "pruning_ratio (ThinK) holds its own key layout: quant_method must be none with it"
        )
    _check_choice("nbits", values["nbits"], QUANT_BITS[method])
    if values.get("head_budget", "uniform") != "uniform" and values.get("varlen"):
        raise ValueError("quant_method needs head_budget='uniform' (or varlen=False)")
    if values.get("gqa_agg") == "none":
        raise ValueError("quant_method needs per-KV-head sets: gqa_agg other than 'none'")
    module, package = QUANT_PACKAGES[method]
    if (
        importlib.util.find_spec(module.split(".")[0]) is None
        or importlib.util.find_spec(module) is None
    ):
        raise ValueError(
            f"quant_method={method!r} needs the {package} package: pip install {package}"
        )


def knob_table() -> str:
    """A markdown table of every knob: name, default, allowed values, who reads it, what it does."""
    rows = ["| knob | default | values | read by | meaning |", "|---|---|---|---|---|"]
    for name, versions in all_knobs().items():
        for owners, k in versions:
            who = "all" if len(owners) == len(METHODS) else ", ".join(owners)
            cond = f" (when {k.condition()})" if k.when else ""
            values = " \\| ".join(map(str, k.choices)) if k.choices else (k.rule or k.kind.__name__)
            rows.append(f"| `{name}` | `{k.default}` | {values} | {who}{cond} | {k.help} |")
    return "\n".join(rows)
