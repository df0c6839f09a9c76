"""The final answer of a generated solution, and its grade.

MATH500 and AIME (Qwen2.5-Math's ``extract_answer``, written here): Minerva's "final answer is $...$. I hope",
else the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, braces matched; ``\\boxed 5`` up to a
``$``; a box not closed: up to the end), else what follows the last "the answer is" /
"final answer is" (up to the end of its line: Qwen's takes the rest of the text), else the last number; then
graded by :func:`restkv.bench.reasoning.latex.math_equal`.

GSM8K (lm-evaluation-harness's ``gsm8k`` task: its filters and ``exact_match``): the "#### N" of the data's own
format (strict-match: the first ``#### (-?[0-9.,]+)``), else the number in the last ``\\boxed{}`` (the
prompt's format), else the last number of the text (flexible-extract: the last match of
``(-?[$0-9.,]{2,})|(-?[0-9]+)``); prediction and reference compared as strings after removing commas, ``$``,
everything up to "#### " and a final period, ignoring case (lm-eval's ``regexes_to_ignore``).
"""

from __future__ import annotations

import re

from .latex import braced, math_equal

INVALID = "[invalid]"  # lm-eval's fallback when a filter finds nothing
GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
GSM8K_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
GSM8K_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def last_boxed(text: str):
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` (``\\boxed 5``: up to ``$``; not
    closed, as a generation cut short leaves it: up to the end), or None when there is none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)", text)]
    if not starts:
        return None
    rest = text[starts[-1] :]
    if rest.startswith("{"):
        found = braced(rest, 0)
        return rest[1:] if found is None else found[0]
    if rest.startswith(" "):
        return rest.split("$")[0].strip()
    return None


def extract_math(text: str):
    """The final answer of a MATH500 / AIME solution (module docstring), None when it gives none."""
    answer = None
    if "final answer is $" in text and "$. I hope" in text:  # Minerva's format
        answer = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0]
    if answer is None:
        answer = last_boxed(text)
    if answer is None:
        for cue in ("he answer is", "final answer is"):
            if cue in text:
                answer = text.split(cue)[-1].strip().split("\n")[0]
                break
    if answer is None:
        numbers = re.findall(r"-?\d*\.?\d+", text.replace(",", ""))
        answer = numbers[-1] if numbers else None
    if answer is None:
        return None
    answer = re.sub(r"\n\s*", "", answer).strip()
    answer = answer[1:] if answer.startswith(":") else answer
    answer = answer.strip().rstrip("$").rstrip(".").rstrip("/").strip()
    return answer or None


def lm_eval_regex(pattern: re.Pattern, text: str, group_select: int) -> str:
    """lm-eval's ``RegexFilter``: the ``group_select``-th match (its first non-empty group), or ``[invalid]``."""
    found = pattern.findall(text)
    if not found:
        return INVALID
    match = found[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), INVALID)
    return match.strip()


def extract_gsm8k(text: str) -> str:
    """The final answer of a GSM8K solution (module docstring); ``[invalid]`` when it has no number."""
    strict = lm_eval_regex(GSM8K_STRICT, text, 0)
    if strict != INVALID:
        return strict
    boxed = last_boxed(text)
    return lm_eval_regex(GSM8K_FLEXIBLE, boxed if boxed else text, -1)


def gsm8k_clean(text: str) -> str:
    """lm-eval's ``exact_match`` preprocessing of the gsm8k task (``regexes_to_ignore``, ``ignore_case``)."""
    for pattern in GSM8K_IGNORE:
        text = re.sub(pattern, "", text)
    return text.strip().lower()


def extract(dataset: str, text: str):
    """The final answer of ``text`` as the grader of ``dataset`` reads it."""
    return extract_gsm8k(text) if dataset == "gsm8k" else extract_math(text)


def is_correct(dataset: str, text: str, reference) -> bool:
    """Whether the solution ``text`` ends with the right answer to a ``dataset`` problem."""
    if dataset == "gsm8k":
        return gsm8k_clean(extract_gsm8k(text)) == gsm8k_clean(str(reference))
    return math_equal(extract_math(text), reference)
