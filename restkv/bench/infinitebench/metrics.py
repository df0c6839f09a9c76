"""InfiniteBench scorers, with the semantics of the official ``src/compute_scores.py``.

Each scorer takes ``(prediction, answers)``, ``answers`` as returned by
:func:`restkv.bench.infinitebench.tasks.answers`, and returns a float in [0, 1].
"""

import re

from ..longbench.metrics import f1_score, normalize_zh_answer, qa_f1

NEEDS = ("rouge_score",)  # of restkv's bench extra


def first_int(prediction):
    """First run of digits in ``prediction`` ('' when there is none)."""
    match = re.search(r"[0-9]+", prediction)
    return match.group(0) if match else ""


def _words(prediction, chars):
    for c in chars:
        prediction = prediction.replace(c, " ")
    return prediction.split()


def _squeeze(text):
    while "  " in text:
        text = text.replace("  ", " ")
    return text


def passkey(prediction, answers):
    """1 when the first integer of the prediction is a reference."""
    return float(any(first_int(prediction) == str(a) for a in answers))


number_string = passkey


def kv_retrieval(prediction, answers):
    """1 when a reference is one of the prediction's words (split on punctuation)."""
    words = _words(prediction, ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"])
    return float(any(str(a) in words for a in answers))


def longdialogue_qa_eng(prediction, answers):
    """1 when the first reference name is one of the prediction's upper-cased words."""
    words = [
        w.upper() for w in _words(prediction, ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"])
    ]
    return float(answers[0] in words)


def code_run(prediction, answers):
    """1 when the last word of the prediction is the integer result."""
    words = _words(prediction.strip(), ["\n", ".", "`", "'", '"', ":"])
    try:
        return float(int(words[-1]) == int(answers[0]))
    except (IndexError, ValueError):
        return 0.0


def _after_prefix(text, prefixes, starts):
    """Official answer-prefix search: the first prefix found decides."""
    for prefix in prefixes:
        idx = text.find(prefix)
        if idx == -1:
            continue
        rest = text[idx + len(prefix) + 1 :]
        return float(len(text) >= idx + len(prefix) + 1 and any(rest.startswith(s) for s in starts))
    return None


def code_debug(prediction, answers):
    """Letter right at the start, or function name / letter after an answer prefix."""
    fn_name = answers[0]
    letter = answers[1]
    if prediction[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    pred = prediction.strip()
    for c in ["\n", "`", "'", '"', "-", "*", "Option", "option"]:
        pred = pred.replace(c, " ")
    found = _after_prefix(_squeeze(pred), ["answer is:", "is:", "answer:"], [letter, fn_name])
    return found or 0.0


def longbook_choice_eng(prediction, answers):
    """First letter, else the letter after an answer prefix, else the first A-D word."""
    if not prediction:
        return 0.0
    if prediction[0] in "ABCD":
        return float(prediction[0] in answers)
    pred = prediction
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    pred = _squeeze(pred)
    found = _after_prefix(pred, ["answer is:", "answer:", "answer is", "option is"], answers)
    if found is not None:
        return found
    for word in pred.split():
        if word in "ABCD":
            return float(word in answers)
    return 0.0


def longbook_qa_eng(prediction, answers):
    """English QA F1, max over references."""
    return max([0.0] + [qa_f1(prediction, a) for a in answers])


def longbook_qa_chn(prediction, answers):
    """Character-level F1 of the normalized strings, max over references."""
    pred = list(normalize_zh_answer(prediction))
    return max([0.0] + [f1_score(pred, list(normalize_zh_answer(a))) for a in answers])


def longbook_sum_eng(prediction, answers):
    """ROUGE-Lsum F (``rouge_score``, no stemming), max over references."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)
    return max([0.0] + [scorer.score(a, prediction)["rougeLsum"].fmeasure for a in answers])


def _number(value):
    if isinstance(value, (int, float)):
        return value
    return float(value) if re.fullmatch(r"-?\d+\.\d+", str(value).strip()) else int(value)


def math_find(prediction, answers):
    """1 when the first number of the prediction equals the reference (int or float)."""
    label = _number(answers[0])
    match = re.search(r"\d+\.\d+|\d+", prediction)
    if match is None:
        return 0.0
    if isinstance(label, int):
        return float(match.group(0).isdigit() and int(match.group(0)) == label)
    return float(float(match.group(0)) == label)


def math_calc(prediction, answers):
    """Share of the leading intermediate values right (digit runs, in order, until the first error)."""
    label = [_number(a) for a in answers]
    numbers = [int(x) for x in re.split("[^0-9]", prediction) if x]
    right = 0
    for want, got in zip(label, numbers):
        if want != got:
            break
        right += 1
    return right / len(label)


def score_record(task, prediction, answers):
    """Score one prediction of ``task`` against its reference ``answers``."""
    return float(globals()[task](prediction, answers))
