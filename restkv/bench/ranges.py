"""Value grids of the command line: ``1024``, ``1024:4096:1024`` (a step) and ``0:100/5`` (a count).

- ``N``: one value.
- ``start:stop:step``: ``start, start + step, ...`` up to ``stop``, as Python's ``range`` reads a step,
  with ``stop`` included. ``stop`` must lie on the grid: ``0:100:3`` is an error (it would stop at 99),
  so a count written in the earlier ``start:stop:num`` form (``0:100:11``, ``0:100:41``) never turns
  silently into a step.
- ``start:stop/num``: ``num`` evenly spaced values from ``start`` to ``stop``, both included
  (``numpy.linspace``); integer grids round to the nearest integer.

Imports nothing heavy: the runners expand their grids while parsing their flags.
"""

from __future__ import annotations

SYNTAX = "N, start:stop:step (stop included, on the grid) or start:stop/num (num values, both ends)"


def _number(text: str, kind, item: str, flag: str):
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} {item!r}: {text!r} is not a number; expected {SYNTAX}") from None
    if kind is int and value != int(value):
        raise ValueError(f"{flag} {item!r}: {text} is not an integer")
    return kind(value)


def _steps(start, stop, step, kind, item: str, flag: str) -> list:
    if step == 0:
        raise ValueError(f"{flag} {item!r}: the step must not be 0")
    if (stop - start) * step < 0:
        raise ValueError(
            f"{flag} {item!r}: a step of {step:g} never goes from {start:g} to {stop:g}"
        )
    count = (stop - start) / step
    steps = round(count)
    if abs(count - steps) > 1e-9 * max(1.0, abs(count)):
        last = start + int(count) * step
        raise ValueError(
            f"{flag} {item!r}: {stop:g} is not on the grid {start:g}, {start + step:g}, ... (which stops at {last:g}); "
            f"start:stop:step includes stop and needs it on the grid. For evenly spaced values give their "
            f"number: {start:g}:{stop:g}/N"
        )
    values = [start + i * step for i in range(steps + 1)]
    return [kind(v) if kind is int else round(v, 6) for v in values]


def _linspace(start, stop, num: int, kind) -> list:
    if num == 1:
        values = [float(start)]
    else:
        values = [start + (stop - start) * i / (num - 1) for i in range(num)]
    return [int(round(v)) if kind is int else round(v, 6) for v in values]


def parse_range(items, kind=int, flag: str = "range") -> list:
    """Expand ``["1000", "2000:4000:1000", "0:100/3"]`` (see the module) into a list of values.

    Order is kept and repeats are dropped. ``flag`` names the option in error messages.

    Raises
    ------
    ValueError
        For an item of another form (``1:2``, ``0:100:3`` whose stop is off the grid), a step of 0, a
        count below 1 or a non-integer value of an integer grid.
    """
    out = []
    for item in items:
        text = str(item).strip()
        if "/" in text:
            bounds, _, count = text.partition("/")
            parts = bounds.split(":")
            if len(parts) != 2:
                raise ValueError(f"{flag} {item!r}: expected {SYNTAX}")
            start, stop = (_number(p, float, item, flag) for p in parts)
            num = _number(count, int, item, flag)
            if num < 1:
                raise ValueError(f"{flag} {item!r}: the number of values must be >= 1")
            values = _linspace(start, stop, num, kind)
        else:
            parts = text.split(":")
            if len(parts) == 1:
                values = [_number(parts[0], kind, item, flag)]
            elif len(parts) == 3:
                start, stop, step = (_number(p, kind, item, flag) for p in parts)
                values = _steps(start, stop, step, kind, item, flag)
            else:
                raise ValueError(f"{flag} {item!r}: expected {SYNTAX}")
        out += [v for v in values if v not in out]
    return out


def shown(values) -> str:
    """A grid as the runners print it: ``0, 25, 50, 75, 100``."""
    return ", ".join(f"{v:g}" for v in values)
