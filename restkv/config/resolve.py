"""Resolving a config: aliases replaced, the preset and defaults applied, every knob validated and only the
knobs the method reads kept, then the checks across knobs (general, strategies', method's, quantization)."""

from __future__ import annotations

import importlib.util

from ..methods import REGISTRY, method_key, unknown_method
from ..strategies import STRATEGIES
from .declarations import ALIASES, PRESETS, QUANT_BITS, QUANT_PACKAGES, _known, declared


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
    method = method_key(given.get(
        "method", PRESETS[preset]["method"] if preset else defaults.get("method", "restkv")
    ))
    if method not in REGISTRY:
        raise ValueError(f"method: {unknown_method(given.get('method', defaults.get('method')))}")
    if preset and PRESETS[preset]["method"] != method:
        raise ValueError(
            f"preset {preset!r} holds {PRESETS[preset]['method']}'s knobs; method is {method}"
        )
    if default_preset and PRESETS[default_preset]["method"] == method and not preset:
        preset = default_preset  # a runner's --preset reaches the configs of its method only
    base = {**(_unalias(PRESETS[preset])[0] if preset else {}), **defaults}
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
