"""LongBench metrics, with the semantics of the official ``metrics.py``.

Every metric has the signature ``metric(prediction, ground_truth, all_classes=None)``
and returns a float in [0, 1]. :func:`score_record` applies the first-line rule
and takes the maximum over the references.
"""

import functools
import re
import string
import sys
import warnings

from ...data.answers import f1_score, normalize_answer, qa_f1  # noqa: F401 (LongBench's metrics)
from ...lazy import require
from .tasks import FIRST_LINE, METRICS

NEEDS = ("jieba", "rouge", "fuzzywuzzy")  # of restkv's bench extra


@functools.lru_cache(maxsize=None)
def scorers():
    """``(jieba, rouge.Rouge, fuzzywuzzy.fuzz)``, imported on first use (one-line error without the bench extra)."""
    require(*NEEDS, needed_by="LongBench scoring")
    import jieba
    from rouge import Rouge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fuzzywuzzy warns when python-Levenshtein is absent
        from fuzzywuzzy import fuzz
    jieba.setLogLevel(60)
    return jieba, Rouge, fuzz


def _cut(text):
    return scorers()[0].cut(text, cut_all=False)


ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"
    "–—‘’‛“”„‟…‧﹏."
)


def normalize_zh_answer(s):
    """Lower-case, drop ASCII and Chinese punctuation and all whitespace."""
    punct = set(string.punctuation + ZH_PUNCTUATION)
    return "".join("".join(ch for ch in s.lower() if ch not in punct).split())


def _zh_tokens(text):
    tokens = (normalize_zh_answer(t) for t in _cut(text))
    return [t for t in tokens if t]


def qa_f1_zh(prediction, ground_truth, all_classes=None):
    """F1 over jieba words, each normalized, empty ones dropped."""
    return f1_score(_zh_tokens(prediction), _zh_tokens(ground_truth))


def rouge(prediction, ground_truth, all_classes=None):
    """ROUGE-L F of the ``rouge`` package; 0 where it raises (e.g. an empty prediction).

    The package rebuilds the LCS recursively, one frame per word; the recursion
    limit is raised for the call so that long summaries get their real score
    instead of a RecursionError turned into 0.
    """
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(
        max(limit, 2 * (len(prediction.split()) + len(ground_truth.split())) + 1000)
    )
    try:
        scores = scorers()[1]().get_scores([prediction], [ground_truth], avg=True)
    except Exception:
        return 0.0
    finally:
        sys.setrecursionlimit(limit)
    return scores["rouge-l"]["f"]


def rouge_zh(prediction, ground_truth, all_classes=None):
    """ROUGE-L F over space-joined jieba words."""
    return rouge(" ".join(_cut(prediction)), " ".join(_cut(ground_truth)))


def classification(prediction, ground_truth, all_classes=None):
    """1/k when the label is among the k class names found in the prediction, else 0.

    As in the official code, a found class that is a proper substring of the
    label is dropped while walking the list (the element after each dropped one
    is not examined), and the difflib fallback of the official code never runs
    (its guard is always true), so nothing found scores 0.
    """
    found = [c for c in (all_classes or []) if c in prediction]
    i = 0
    while i < len(found):
        if found[i] in ground_truth and found[i] != ground_truth:
            del found[i]
        i += 1
    return 1.0 / len(found) if ground_truth in found else 0.0


def _share_of_numbers(prediction, target):
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == str(target) for n in numbers) / len(numbers)


def count(prediction, ground_truth, all_classes=None):
    """Share of the numbers in the prediction equal to the true count."""
    return _share_of_numbers(prediction, ground_truth)


def retrieval(prediction, ground_truth, all_classes=None):
    """Share of the numbers in the prediction equal to N of the label ``Paragraph N``."""
    return _share_of_numbers(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh(prediction, ground_truth, all_classes=None):
    """Share of the numbers in the prediction equal to N of the label ``段落N``."""
    return _share_of_numbers(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def code_sim(prediction, ground_truth, all_classes=None):
    """fuzzywuzzy ratio / 100 between the label and the first line without `, # or //."""
    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return scorers()[2].ratio(first, ground_truth) / 100


def score_record(dataset, prediction, answers, all_classes=None):
    """Score one prediction of ``dataset``: first-line rule, then max over ``answers``.

    Parameters
    ----------
    dataset : str
        LongBench dataset name (LongBench-E files use the same name without ``_e``).
    prediction : str
        The generated text.
    answers : list of str
        Reference answers.
    all_classes : list of str or None
        Class names (trec, lsht).

    Returns
    -------
    float
        Score in [0, 1].
    """
    if dataset in FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = globals()[METRICS[dataset]]
    return max([0.0] + [metric(prediction, gt, all_classes=all_classes) for gt in answers])
