"""Knob declarations: what a method or a strategy reads, with its default, type, allowed values and meaning.

Each method (``methods/<name>.py``) and each strategy (budgets, merging, quantization) declares the knobs
it reads next to the code that reads them. Everything else is derived from those declarations: the
config's validation (a knob the chosen method does not read is an error), sweep mode's score memo key,
the runners' flags and their choices, and run labels.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, replace
from typing import Any, Callable


@dataclass(frozen=True)
class Knob:
    """One knob.

    Parameters
    ----------
    name : str
        As in ``configure(model, name=...)`` and the runners' ``--name`` flag.
    default
        Its value when not given; its type is the knob's type (``str`` for a ``None`` default).
    help : str
        One line: what it does.
    choices : tuple
        The allowed values, if it is a choice.
    check : callable, optional
        ``check(value) -> bool``; ``rule`` says it in words. A rule that is a bound (``">= 0"``,
        ``"> 1"``, ``"in (0, 1]"``: ``bound_check``) is the check itself: give ``check`` only for
        other rules (``"an odd integer >= 1"``).
    when : dict or tuple of pairs
        Read only when each named knob has one of the listed values, e.g. ``{"pooling": ("adaptive",)}``.
    stage : str
        ``"score"``: read by the scorer, so it keys sweep mode's score memo; ``"select"``: read after
        scoring (how scores become a kept set), so configs differing only there share scores.
    nullable : bool
        ``None`` is allowed (it means off).
    of : type, optional
        The type of a knob whose default is ``None`` (else ``str``).
    """

    name: str
    default: Any
    help: str
    choices: tuple = ()
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    when: Any = ()
    stage: str = "score"
    nullable: bool = False
    of: type | None = None

    def __post_init__(self):
        if self.check is None and self.rule:
            bound_check(self.rule, self.name)  # a rule without a check is a bound, or refused here
        if isinstance(self.when, dict):
            object.__setattr__(self, "when", tuple((k, tuple(v)) for k, v in self.when.items()))

    @property
    def kind(self) -> type:
        return (self.of or str) if self.default is None else type(self.default)

    def but(self, **changes) -> "Knob":
        """A copy with other fields (e.g. another method's default)."""
        return replace(self, **changes)

    def read_when(self, values: dict) -> bool:
        """Whether this knob is read, given the other knobs' values."""
        return all(values.get(k) in allowed for k, allowed in self.when)

    def condition(self, values: dict | None = None, say=None) -> str:
        """The ``when`` clause in words (``"pooling is adaptive"``); given ``values``, only its unmet parts;
        ``say(allowed)`` writes a tuple of allowed values (default: ``a or b``)."""
        parts = [(k, v) for k, v in self.when if values is None or values.get(k) not in v]
        say = say or (lambda allowed: " or ".join(map(str, allowed)))
        return " and ".join(
            f"{k} is {say(v)}"
            + ("" if values is None else f" (not {values.get(k)!r})")
            for k, v in parts
        )

    def validate(self, value):
        """The value, checked (ints accepted for floats, NumPy scalars and 0-d tensors as their Python
        numbers); raises ``ValueError`` naming the knob."""
        if value is None and (self.nullable or self.default is None):
            return None
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            value = value.item()  # a NumPy scalar or a 0-d tensor: its Python number
        kind = self.kind
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (
            kind is bool
            and not isinstance(value, bool)
            or kind is not bool
            and (isinstance(value, bool) or not isinstance(value, kind))
        ):
            raise ValueError(
                f"{self.name} must be {'an' if kind is int else 'a'} {kind.__name__}, got {value!r}"
            )
        if self.choices and value not in self.choices:
            raise ValueError(
                f"{self.name} must be one of {', '.join(map(str, self.choices))}; got {value!r}"
            )
        check = self.check or (bound_check(self.rule, self.name) if self.rule else None)
        if check is not None and not check(value):
            raise ValueError(f"{self.name} must be {self.rule}, got {value!r}")
        return value


OFF = " (or 0: off)"  # a bound's suffix: 0 passes too (it turns the knob off)
_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
_NUMBER = r"(-?\d+(?:\.\d+)?)"  # an int, or a float with its point
_BOUND = re.compile(rf"(>=|>|<=|<) {_NUMBER}")
_INTERVAL = re.compile(rf"in ([\[(]){_NUMBER}, {_NUMBER}([\])])")


def _number(text: str) -> int | float:
    return float(text) if "." in text else int(text)


def bound_check(rule: str, name: str = "a knob") -> Callable[[Any], bool]:
    """The check a bound says: ``"> 0"``, ``">= 1"``, ``"<= 8"``, or an interval ``"in [0, 1)"``
    (``[``, ``]`` closed, ``(``, ``)`` open), each also with ``" (or 0: off)"`` (0 passes too); any
    other rule raises ``ValueError`` naming the knob."""
    check = _bound(rule)
    if check is None:
        raise ValueError(
            f"{name}: rule {rule!r} is not a bound (such as '>= 0' or 'in (0, 1]'); give its check"
        )
    return check


def _bound(rule: str) -> Callable[[Any], bool] | None:
    """``bound_check``'s check, None for a rule that is no bound."""
    if rule.endswith(OFF):
        inner = _bound(rule.removesuffix(OFF))
        return inner and (lambda x: x == 0 or inner(x))
    if match := _BOUND.fullmatch(rule):
        compare, limit = _COMPARE[match[1]], _number(match[2])
        return lambda x: compare(x, limit)
    if match := _INTERVAL.fullmatch(rule):
        low, high = _number(match[2]), _number(match[3])
        above = operator.ge if match[1] == "[" else operator.gt
        below = operator.le if match[4] == "]" else operator.lt
        return lambda x: above(x, low) and below(x, high)
    return None


# Knobs read by several methods (a method may change the default with ``.but(default=...)``).
POOLINGS = ("avgpool", "maxpool", "none")
POOLING = Knob(
    "pooling",
    "none",
    "spatial smoothing of the scores over neighbouring positions",
    choices=POOLINGS,
)
KERNEL_SIZE = Knob(
    "kernel_size",
    7,
    "odd width of the pooling window",
    check=lambda k: k >= 1 and k % 2 == 1,
    rule="an odd integer >= 1",
    when={"pooling": ("avgpool", "maxpool", "adaptive")},
)
GQA_AGG = Knob(
    "gqa_agg",
    "mean",
    "reduction of per-query-head scores over a GQA group: mean, max, the scale-free "
    "sum_norm (each head's scores over their sum) and rank (each head's ranks), or none: one kept set "
    "per query head, as the original (g times the memory)",
    choices=("mean", "max", "sum_norm", "rank", "none"),
    stage="select",
)
VALUE_NORMS = ("l1", "l2")
VALUE_NORM = Knob(
    "value_norm",
    "l1",
    "norm of the values after the head's slice of o_proj: l1 (the reference) or "
    "l2 (exact from a d x d factor, hidden / d times cheaper)",
    choices=VALUE_NORMS,
    stage="select",
)
