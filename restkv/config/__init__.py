"""One validated config of an eviction run, resolved from the knob declarations.

The knobs a config holds are exactly those its method and strategies read: the general ones (``declarations``),
the strategies' (``restkv.strategies.STRATEGIES``: budgets, merging, ranking, decoding) and the method's own
(``methods/<name>.py``), each only when its ``when`` condition holds (``resolve``). Knob names follow the original ReST-KV
command line, so sweep scripts carry over.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..methods import REGISTRY
from .declarations import (  # noqa: F401  (read from here)
    ALIASES,
    EVICTION,
    GENERAL,
    PRESETS,
    QUANT_BITS,
    QUANT_PACKAGES,
    all_knobs,
    declared,
    knob_table,
)
from .resolve import resolve


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
