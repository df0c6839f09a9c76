"""RULER scores: string_match_all (synthetic tasks) and string_match_part (qa), x100."""

import re

CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred):
    """Strip a prediction and turn control characters into newlines, as RULER does."""
    return CONTROL.sub("\n", pred.strip()).strip()


def match_all(pred, refs):
    """Fraction of references found (case-insensitive substring) in ``pred``."""
    pred = pred.lower()
    return sum(r.lower() in pred for r in refs) / len(refs)


def match_part(pred, refs):
    """1 if any reference is found (case-insensitive substring) in ``pred``, else 0."""
    pred = pred.lower()
    return float(any(r.lower() in pred for r in refs))


METRICS = {"string_match_all": match_all, "string_match_part": match_part}


def score(preds, refs, metric):
    """Mean per-sample score x100.

    Parameters
    ----------
    preds : list of str
        Model outputs (post-processed here).
    refs : list of list of str
        Expected answers per sample.
    metric : str
        ``"string_match_all"`` or ``"string_match_part"``.

    Returns
    -------
    float
        In ``[0, 100]``.
    """
    if len(preds) != len(refs) or not preds:
        raise ValueError(
            f"score needs as many predictions as references (>0), got {len(preds)} and {len(refs)}"
        )
    fn = METRICS[metric]
    return 100.0 * sum(fn(postprocess(p), r) for p, r in zip(preds, refs)) / len(preds)
