"""LongBench v2 (THUDM/LongBench-v2): 503 multiple-choice questions on long contexts, its official zero-shot
prompt (``prompts/0shot.txt``) and answer extraction (``pred.py``'s ``extract_answer``).

The chain-of-thought variant (``--cot`` of the official code) asks twice (a reasoning of 1,024 tokens, then a
second prompt with the reasoning and without the text) and is not run here.
"""

from __future__ import annotations

import re

from ..hubdata import Source

SOURCE = Source("longbench_v2", "THUDM/LongBench-v2", split="train", stems=("longbench_v2", "data"), own_folder=False)

FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question", "choice_A", "choice_B",
          "choice_C", "choice_D", "answer", "context")
"""Fields of a record of the official ``data.json``."""

TEMPLATE = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
    "Format your response as follows: \"The correct answer is (insert answer here)\"."
)
"""The official zero-shot template, character for character."""

MAX_NEW_TOKENS = 128
"""The official generation length without chain of thought."""

DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")


def _fill(template, record):
    values = {
        "$DOC$": record["context"].strip(),
        "$Q$": record["question"].strip(),
        **{f"$C_{c}$": record[f"choice_{c}"].strip() for c in "ABCD"},
    }
    return re.sub(r"\$DOC\$|\$Q\$|\$C_[ABCD]\$", lambda m: values[m.group(0)], template)


def make_prompt(record):
    """The official prompt of ``record`` (each field stripped, as ``pred.py`` does; filled in one pass, so text
    inside the context that looks like a placeholder stays)."""
    return _fill(TEMPLATE, record)


def question_text(record):
    """The end of :func:`make_prompt` that is its question: the template after the document."""
    return _fill(TEMPLATE.split("$DOC$", 1)[1], record)


def extract_answer(response):
    """The chosen letter of a response, as ``pred.py``: "The correct answer is (X)", then "... is X", else None
    (asterisks removed first, the response stripped)."""
    response = response.strip().replace("*", "")
    match = re.search(r"The correct answer is \(([A-D])\)", response)
    if match:
        return match.group(1)
    match = re.search(r"The correct answer is ([A-D])", response)
    return match.group(1) if match else None
