"""SCBench's scorers (``compute_scores.py``, its "same context, different query" mode), one question at a time.

Each takes ``(prediction, reference)``, the reference as :func:`restkv.bench.scbench.tasks.references` gives it,
and returns a float in [0, 1]. Where SCBench's code iterates over a reference that is a string (so over its
characters: ``scbench_many_shot`` and ``scbench_qa_chn``, whose answers are strings, and ``scbench_vt`` if its
answer is one), the string is scored here as one reference (the substring match and the character F1 the
scorers are written for).
"""

from __future__ import annotations

import re

from ..infinitebench.metrics import longbook_choice_eng, longbook_qa_chn, longbook_sum_eng

NEEDS = ("rouge_score",)  # scbench_summary's ROUGE-Lsum, of restkv's bench extra


def _as_list(reference):
    return list(reference) if isinstance(reference, (list, tuple)) else [reference]


def contains(prediction, reference):
    """scbench_kv, scbench_prefix_suffix: 1 when the reference is inside the prediction."""
    return float(str(reference) in prediction)


def string_match_all(prediction, reference):
    """scbench_vt: the share of the references inside the prediction (case ignored), rounded to 2 decimals."""
    refs = _as_list(reference)
    return round(sum(str(r).lower() in prediction.lower() for r in refs) / len(refs), 2)


def any_inside(prediction, reference):
    """scbench_qa_eng, scbench_many_shot: 1 when a reference is inside the prediction (upper-cased, stripped)."""
    pred = prediction.strip().upper()
    return float(any(str(r).upper() in pred for r in _as_list(reference)))


def choice(prediction, reference):
    """scbench_choice_eng: InfiniteBench's choice scorer on the stripped prediction, which also takes a
    prediction that is the option text itself (reference ``[option text, letter]``)."""
    pred = prediction.strip()
    if pred and pred[0] not in "ABCD" and pred in reference:
        return 1.0
    return longbook_choice_eng(pred, reference)


def char_f1(prediction, reference):
    """scbench_qa_chn: character F1 of the normalized strings."""
    return longbook_qa_chn(prediction, _as_list(reference))


def first_number(prediction, reference):
    """scbench_mf: 1 when the first number of the prediction is the reference (an int: compared as
    ``int(float(x))``)."""
    found = re.search(r"\d+\.\d+|\d+", prediction)
    if found is None:
        return 0.0
    if isinstance(reference, int):
        return float(int(float(found.group(0))) == reference)
    return float(float(found.group(0)) == float(reference))


def rouge_lsum(prediction, reference):
    """scbench_summary: ROUGE-Lsum F (``rouge_score``, no stemming)."""
    return longbook_sum_eng(prediction, _as_list(reference))


SCORERS = {
    "scbench_kv": contains,
    "scbench_prefix_suffix": contains,
    "scbench_vt": string_match_all,
    "scbench_qa_eng": any_inside,
    "scbench_qa_chn": char_f1,
    "scbench_choice_eng": choice,
    "scbench_many_shot": any_inside,
    "scbench_mf": first_number,
    "scbench_summary": rouge_lsum,
}


def score_turns(task, predictions, references):
    """The mean score of a record's answers (one per question)."""
    if len(predictions) != len(references):
        raise ValueError(f"{task}: {len(predictions)} answers for {len(references)} questions")
    return sum(SCORERS[task](p, r) for p, r in zip(predictions, references)) / len(references)
