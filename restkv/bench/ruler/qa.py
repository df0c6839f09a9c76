"""Question answering over many documents (qa_1: SQuAD, qa_2: HotpotQA)."""

import functools
import json
from pathlib import Path

from restkv.bench.ruler.tasks import FAMILIES

DOCUMENT = "Document {i}:\n{document}"
FORMATS = {
    "squad": "SQuAD JSON (e.g. dev-v2.0.json: data[].paragraphs[].context/qas[])",
    "hotpotqa": "HotpotQA JSON (e.g. hotpot_dev_distractor_v1.json: [].question/answer/context)",
}


def _field(obj, key, where):
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    return obj[key]


@functools.cache
def read_squad(path):
    """Questions and documents of a SQuAD file (unanswerable questions dropped).

    Returns
    -------
    tuple of (list of dict, list of str)
        Questions ``{query, outputs, gold, more}`` (document indices) and documents.
    """
    data = _field(json.loads(Path(path).read_text()), "data", str(path))
    docs = sorted(
        {
            _field(p, "context", f"{path}: data[{i}].paragraphs[{j}]")
            for i, d in enumerate(data)
            for j, p in enumerate(_field(d, "paragraphs", f"{path}: data[{i}]"))
        }
    )
    ids = {c: k for k, c in enumerate(docs)}
    questions = []
    for i, d in enumerate(data):
        article_docs = [ids[p["context"]] for p in d["paragraphs"]]
        for j, p in enumerate(d["paragraphs"]):
            for k, qa in enumerate(_field(p, "qas", f"{path}: data[{i}].paragraphs[{j}]")):
                where = f"{path}: data[{i}].paragraphs[{j}].qas[{k}]"
                if qa.get("is_impossible", False):
                    continue
                answers = [
                    _field(a, "text", where + ".answers[]") for a in _field(qa, "answers", where)
                ]
                questions.append(
                    {
                        "query": _field(qa, "question", where),
                        "outputs": answers,
                        "gold": [ids[p["context"]]],
                        "more": [t for t in article_docs if t != ids[p["context"]]],
                    }
                )
    return questions, docs


@functools.cache
def read_hotpotqa(path):
    """Questions and documents of a HotpotQA file (same return value as ``read_squad``)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of questions")

    def doc(pair, where):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"{where}: context entries must be [title, sentences]")
        return f"{pair[0]}\n{''.join(pair[1])}"

    texts = [
        [doc(c, f"{path}: [{i}].context") for c in _field(d, "context", f"{path}: [{i}]")]
        for i, d in enumerate(data)
    ]
    docs = sorted({t for ts in texts for t in ts})
    ids = {c: k for k, c in enumerate(docs)}
    questions = [
        {
            "query": _field(d, "question", f"{path}: [{i}]"),
            "outputs": [_field(d, "answer", f"{path}: [{i}]")],
            "gold": [ids[t] for t in ts],
            "more": [],
        }
        for i, (d, ts) in enumerate(zip(data, texts))
    ]
    return questions, docs


READERS = {"squad": read_squad, "hotpotqa": read_hotpotqa}


def build(rng, size, question, docs, others):
    """One qa sample.

    Parameters
    ----------
    rng : random.Random
    size : int
        Number of documents (at least the gold ones).
    question : dict
        ``{query, outputs, gold, more}`` from a reader.
    docs : list of str
    others : list of int
        Document indices that are neither gold nor ``more`` for this question.

    Returns
    -------
    tuple of (str, str, list of str)
        Prompt, answer prefix, accepted answers.
    """
    gold = question["gold"]
    more = question["more"]
    extra = size - len(gold)
    if extra <= len(more):
        chosen = gold + rng.sample(more, extra)
    else:
        chosen = gold + more + rng.sample(others, min(extra - len(more), len(others)))
    rng.shuffle(chosen)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=docs[d]) for i, d in enumerate(chosen))
    prompt = FAMILIES["qa"]["template"].format(context=context, query=question["query"])
    return prompt, FAMILIES["qa"]["answer_prefix"], question["outputs"]
