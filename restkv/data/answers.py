"""Token F1 of an answer against the expected one (SQuAD's and LongBench's ``qa_f1_score``)."""

from __future__ import annotations

import re
import string
from collections import Counter


def normalize_answer(s):
    """Lower-case, drop ASCII punctuation and the articles a/an/the, squeeze spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction_tokens, ground_truth_tokens):
    """Token-multiset F1 of two token lists (0 when nothing is shared)."""
    same = sum((Counter(prediction_tokens) & Counter(ground_truth_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction, ground_truth, all_classes=None):
    """F1 over whitespace tokens of the English-normalized strings."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())
