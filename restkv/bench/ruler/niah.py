"""Needle-in-a-haystack tasks (niah_single_*, niah_multikey_*, niah_multivalue, niah_multiquery)."""

import numpy as np

from restkv.bench.ruler.sources import distinct_values, essay_words, random_value, split_sentences
from restkv.bench.ruler.tasks import FAMILIES, singular

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]


def minimum_size(haystack, num_k, num_v, num_q):
    """Smallest haystack (units) a sample can be built with."""
    return 1 if haystack == "essay" else max(num_k, num_q) * num_v


def maximum_size(haystack):
    """Largest haystack (units), or None when unbounded."""
    return len(essay_words()) if haystack == "essay" else None


def _templates(value_type, single):
    """Question template and answer prefix, in singular form for a single answer."""
    texts = [FAMILIES["niah"]["template"], FAMILIES["niah"]["answer_prefix"]]
    if single:
        texts, value_type = [singular(t) for t in texts], value_type[:-1]
    return [t.replace("{type_needle_v}", value_type) for t in texts]


def _essay_context(rng, size, needles):
    sentences = split_sentences(" ".join(essay_words()[:size]))
    cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
    pieces = []
    start = 0
    for cut, needle in zip(cuts, needles):
        pieces += sentences[start:cut] + [needle]
        start = cut
    return " ".join(pieces + sentences[start:])


def _distractors(rng, size, key_type, value_type, keys, values):
    """Needles with fresh keys and values, drawn pairwise so ``size + 1`` extends ``size``."""
    units = []
    while len(units) < size:
        key = random_value(rng, key_type)
        value = random_value(rng, value_type)
        if key not in keys and value not in values:
            keys.add(key)
            values.add(value)
            units.append(NEEDLE.format(type_needle_v=value_type, key=key, value=value))
    return units


def _unit_context(rng, size, needles, haystack, key_type, value_type, keys, answers):
    if haystack == "repeat":
        units = [NOISE] * size
    else:
        units = _distractors(rng, size, key_type, value_type, set(keys), set(answers))
    for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
        units.insert(index, needle)
    return "\n".join(units)


def build(rng, size, haystack, key_type, value_type, num_k, num_v, num_q):
    """One niah sample.

    Parameters
    ----------
    rng : random.Random
    size : int
        Haystack size: essay words, noise paragraphs or distractor needles.
    haystack : str
        ``"essay"``, ``"repeat"`` or ``"needle"``.
    key_type, value_type : str
        ``"numbers"``, ``"words"`` or ``"uuids"``.
    num_k, num_v, num_q : int
        Keys inserted, values per key, keys asked for.

    Returns
    -------
    tuple of (str, str, list of str)
        Prompt, answer prefix, expected values.
    """
    num_k = max(num_k, num_q)
    keys = distinct_values(rng, key_type, num_k)
    values = distinct_values(rng, value_type, num_k * num_v)
    values = [values[i * num_v : (i + 1) * num_v] for i in range(num_k)]
    needles = [
        NEEDLE.format(type_needle_v=value_type, key=k, value=v)
        for k, vs in zip(keys, values)
        for v in vs
    ]
    rng.shuffle(needles)
    if haystack == "essay":
        context = _essay_context(rng, size, needles)
    elif haystack in ("repeat", "needle"):
        flat = [v for vs in values for v in vs]
        context = _unit_context(rng, size, needles, haystack, key_type, value_type, keys, flat)
    else:
        raise ValueError(f"unknown haystack {haystack!r}; expected essay, repeat or needle")
    asked = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = queries[0] if num_q == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    template, prefix = _templates(value_type, num_q * num_v == 1)
    return (template.format(context=context, query=query), prefix.format(query=query), answers)
