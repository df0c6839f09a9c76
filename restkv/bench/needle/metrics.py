"""Scores of a needle answer, and how much of the needle eviction kept."""

import re

from ...lazy import torch

_ROUGE = None


def rouge1(target, prediction):
    """ROUGE-1 (precision, recall, F) of ``prediction`` against ``target``, stemmed, as the original."""
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer

        _ROUGE = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    return _ROUGE.score(target, prediction)["rouge1"]


def digit_score(response, answer):
    """Fraction of ``answer``'s digits that the response's best digit run has at the same place.

    Digit runs may contain ``,`` or spaces between digit groups; a run of a
    different length is divided by the longer length.
    """
    runs = [re.sub(r"\D", "", r) for r in re.findall(r"\d(?:[\d,]|\s(?=\d))*", response)]
    best = 0.0
    for run in runs:
        best = max(best, sum(a == b for a, b in zip(run, answer)) / max(len(run), len(answer)))
    return best


def _words(text):
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def score(response, needle_text, answer):
    """Scores of one response.

    Returns
    -------
    dict
        ``rouge1_f`` (response vs the needle sentence), ``score`` (graded:
        :func:`digit_score` for numeric answers, else ROUGE-1 recall of the
        answer) and ``exact`` (1.0 when the answer appears verbatim, words or
        digits).
    """
    if answer.isdigit():
        graded = digit_score(response, answer)
        exact = float(answer in re.findall(r"\d+", re.sub(r"(?<=\d)[, ](?=\d)", "", response)))
    else:
        graded = rouge1(answer, response).recall
        exact = float(f" {_words(answer)} " in f" {_words(response)} ")
    return {"rouge1_f": rouge1(needle_text, response).fmeasure, "score": graded, "exact": exact}


def needle_kept(kept, span, index=0):
    """Fraction of the needle's tokens kept, averaged over layers and KV heads.

    Parameters
    ----------
    kept : list
        Per layer, the kept positions of a batch (``restkv.kept_positions``): LongTensor
        ``[batch, kv_heads, kept]``, or None for a layer that is not evicted.
    span : tuple of int or None
        The needle's ``[start, end)`` token positions.
    index : int
        The prompt's row in the batch.

    Returns
    -------
    float or None
        None when no layer reports kept positions or the needle was truncated away.
    """
    layers = [k[index] for k in (kept or []) if k is not None]
    if not layers or span is None:
        return None
    pos = torch.arange(*span, device=layers[0].device)
    return float(
        torch.stack([(k.unsqueeze(-1) == pos).any(-2).float().mean() for k in layers]).mean()
    )
