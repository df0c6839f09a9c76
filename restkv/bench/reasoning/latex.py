"""Is a final answer equal to the reference: the normalisation of the MATH reference code (Hendrycks et al.'s
``strip_string``) with the additions of Qwen2.5-Math's evaluation (``parser.strip_string``), then its grader's
tests (``grader.math_equal``): equal strings, equal numbers, equal tuples element by element, equal expressions.

Where this differs from Qwen2.5-Math's code on purpose:

- a number equals a reference only within 1e-4 relative (Qwen's also accepts ``reference * 100`` and ``/ 100``);
- ``1,000`` is a number only with groups of three digits (Qwen's reads ``1,2`` as ``12``);
- `` and `` between answers becomes a comma (Qwen's deletes ``and``: ``1 and 2`` read ``12``);
- units are removed only as a trailing ``\\text{...}`` or a trailing unit word after a number (Qwen's removes
  words such as ``a``, ``t`` or ``m`` anywhere);
- expressions are compared with sympy on a LaTeX subset parsed here (``\\frac``, ``\\sqrt``, ``\\pi``, ``^``,
  ``\\cdot``; Qwen's uses ``latex2sympy2``), and only after the text passed a whitelist (no code runs).
"""

from __future__ import annotations

import math
import re

UNITS = (
    "units", "unit", "square units", "sq units", "cm", "centimeters", "m", "meters", "km", "kilometers",
    "mm", "inches", "inch", "feet", "foot", "ft", "yards", "miles", "mph", "degrees", "degree", "dollars",
    "cents", "hours", "hour", "minutes", "seconds", "days", "weeks", "years", "pounds", "ounces", "grams",
    "kg", "liters", "gallons", "people", "students",
)
_UNIT = re.compile(r"^(-?[\d.,/]+)\s*(?:" + "|".join(sorted(map(re.escape, UNITS), key=len, reverse=True)) + r")$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)$")


def braced(text: str, start: int):
    """``(content, end)`` of the brace group opening at ``text[start] == '{'`` (None when unclosed)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    return None


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}`` (the MATH reference's ``_fix_fracs``)."""
    head, *rest = s.split("\\frac")
    out = head
    for part in rest:
        out += "\\frac"
        if part.startswith("{"):
            out += part
        elif len(part) < 2:
            return s
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _fix_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``: the single character after ``\\sqrt`` (the MATH reference's ``_fix_sqrt``)."""
    return re.sub(r"\\sqrt([^{\[\\])", r"\\sqrt{\1}", s)


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` for two integers."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def normalize(answer) -> str:
    """The comparable form of a final answer (string rules of the module docstring)."""
    s = str(answer).strip().replace("\n", "").rstrip(".")
    s = s.replace("\\!", "").replace("\\\\", "\\").replace("{,}", ",")
    s = re.sub(r"\\begin\{array\}\{.*?\}", r"\\begin{pmatrix}", s).replace("\\end{array}", "\\end{pmatrix}")
    s = s.replace("bmatrix", "pmatrix").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\neq", "\\ne").replace("\\leq", "\\le").replace("\\geq", "\\ge")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\{", "{").replace("\\}", "}")
    unitless = re.sub(r"\\(?:text|mbox|mathrm)\{[^{}]*\}$", "", s).strip()
    s = unitless or s
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    s = s.replace("\\(", "").replace("\\)", "")
    s = re.sub(r"\\(?:text|mbox|mathrm|textbf|mathbf)\{(.*?)\}", r"\1", s).strip()
    s = _UNIT.sub(r"\1", s)
    for key in ("x=", "y=", "z=", "x\\in", "y\\in", "z\\in", "x\\to", "y\\to", "z\\to"):
        s = s.replace(key, "")
    s = s.replace("\\emptyset", "{}").replace("(-\\infty,\\infty)", "\\mathbb{R}")
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = s.replace("infinity", "\\infty")
    if "\\infty" not in s:
        s = s.replace("inf", "\\infty")
    s = re.sub(r"\s+and\s+", ",", s)
    if "j" in s and "i" not in s:
        s = s.replace("j", "i")
    s = re.sub(r"(\d+)\.0*([^\d])", r"\1\2", s)
    s = re.sub(r"(\d+)\.0*$", r"\1", s)
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_a_slash_b(_fix_fracs(s))
    if s.startswith("{") and braced(s, 0) == (s[1:-1], len(s)):
        s = s[1:-1]
    return s


def number(s: str):
    """The float a normalized answer writes plainly (``-3``, ``0.25``, ``1,000``), else None."""
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return float(s) if _NUMBER.match(s) else None


def split_top(s: str) -> list:
    """``s`` split at its commas outside brackets and braces."""
    parts, depth, last = [], 0, 0
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(s[last:i])
            last = i + 1
    return parts + [s[last:]]


def items(s: str):
    """``(brackets, items)`` of a tuple, interval or list answer (``(1,2]`` -> ``("(]", ["1", "2"])``; a list
    without brackets has ``""``), else None."""
    inner, brackets = s, ""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        depth = 0
        for c in s[1:-1]:
            depth += (c in "([{") - (c in ")]}")
            if depth < 0:
                break
        else:
            inner, brackets = s[1:-1], s[0] + s[-1]
    parts = split_top(inner)
    return (brackets, parts) if len(parts) > 1 else None


def _small_powers(s: str) -> bool:
    """Whether every exponent of ``s`` is plain and small (no ``**`` inside or after it, no integer above 1000),
    so that sympy cannot be made to compute a huge power."""
    for m in re.finditer(r"\*\*", s):
        rest = s[m.end() :].lstrip()
        if rest.startswith("("):
            depth, end = 0, len(rest)
            for i, c in enumerate(rest):
                depth += (c == "(") - (c == ")")
                if depth == 0:
                    end = i + 1
                    break
            exponent = rest[:end]
        else:
            exponent = re.match(r"-?[\w.]*", rest).group(0)
        chained = rest[len(exponent) :].lstrip().startswith("**")  # a**b**c is a**(b**c)
        if chained or "**" in exponent or any(int(n) > 1000 for n in re.findall(r"\d+", exponent)):
            return False
    return True


def _latex_to_python(s: str):
    """A sympy-parsable text of a LaTeX expression in the subset this module reads, else None."""
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", " pi ").replace("\\infty", " oo ")
    while "\\frac{" in s or "\\sqrt" in s:
        i = min(x for x in (s.find("\\frac{"), s.find("\\sqrt")) if x >= 0)
        if s.startswith("\\frac{", i):
            num = braced(s, i + 5)
            den = braced(s, num[1]) if num and num[1] < len(s) and s[num[1]] == "{" else None
            if den is None:
                return None
            s = s[:i] + f"(({num[0]})/({den[0]}))" + s[den[1] :]
        else:
            j = i + 5
            root = "2"
            if s.startswith("[", j):
                k = s.find("]", j)
                if k < 0:
                    return None
                root, j = s[j + 1 : k], k + 1
            arg = braced(s, j) if s.startswith("{", j) else None
            if arg is None:
                return None
            s = s[:i] + f"(({arg[0]})**(1/({root})))" + s[arg[1] :]
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    if "\\" in s or not re.fullmatch(r"[0-9a-zA-Z+\-*/(). ]*", s) or re.search(r"(?<!\d)\.|\.(?!\d)", s):
        return None
    if any(len(w) > 1 and w not in ("pi", "oo") for w in re.findall(r"[a-zA-Z]+", s)):
        return None
    return s if _small_powers(s) else None


def symbolic_equal(a: str, b: str) -> bool:
    """Whether two normalized answers are the same expression (sympy), for the LaTeX subset read here."""
    if max(len(a), len(b)) > 80:
        return False
    pa, pb = _latex_to_python(a), _latex_to_python(b)
    if pa is None or pb is None:
        return False
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )

        rules = standard_transformations + (implicit_multiplication_application,)
        x, y = (parse_expr(p, transformations=rules, evaluate=True) for p in (pa, pb))
        if sympy.simplify(x - y) == 0:
            return True
        if x.free_symbols or y.free_symbols:
            return False
        return math.isclose(float(sympy.N(x)), float(sympy.N(y)), rel_tol=1e-4)
    except Exception:  # unparsable or not comparable: not equal
        return False


def math_equal(prediction, reference) -> bool:
    """Whether ``prediction`` (an extracted answer, None when there is none) equals ``reference``."""
    if prediction is None:
        return False
    a, b = normalize(prediction), normalize(reference)
    if a == b:
        return True
    if re.fullmatch(r"\(?[A-E]\)?", a) and re.fullmatch(r"\(?[A-E]\)?", b):
        return a.strip("()") == b.strip("()")
    x, y = number(a), number(b)
    if x is not None and y is not None:
        return math.isclose(x, y, rel_tol=1e-4)
    pa, pb = items(a), items(b)
    if pa is not None or pb is not None:
        if pa is None or pb is None or pa[0] != pb[0] or len(pa[1]) != len(pb[1]):
            return False
        return all(math_equal(p, q) for p, q in zip(pa[1], pb[1]))
    return symbolic_equal(a, b)
