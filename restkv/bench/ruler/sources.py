"""Raw material for the synthetic tasks: word lists, essays, random values."""

import functools
import importlib.resources
import re
import uuid
from pathlib import Path

WORD = re.compile(r"^[a-z]+$")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@functools.cache
def wordlist(name):
    """Lower-case alphabetic words of one ``wonderwords`` list, sorted and unique.

    Parameters
    ----------
    name : str
        ``"noun"``, ``"adjective"`` or ``"verb"``.
    """
    text = (
        importlib.resources.files("wonderwords").joinpath("assets", f"{name}list.txt").read_text()
    )
    return sorted({w.strip() for w in text.splitlines() if WORD.match(w.strip())})


@functools.cache
def common_words():
    """Nouns, adjectives and verbs together (the cwe vocabulary)."""
    return sorted(set(wordlist("noun")) | set(wordlist("adjective")) | set(wordlist("verb")))


@functools.cache
def essay_words():
    """All Paul Graham essays as one list of whitespace-separated words."""
    from restkv.bench.models import essays_dir

    folder = Path(essays_dir())
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays (*.txt) in {folder}")
    text = " ".join(f.read_text(encoding="utf-8") for f in files)
    return re.sub(r"\s+", " ", text).strip().split(" ")


def split_sentences(text):
    """Split text after ``.``, ``!`` or ``?`` followed by whitespace."""
    return [s for s in SENTENCE_END.split(text.strip()) if s]


def random_value(rng, kind):
    """One random needle key or value.

    Parameters
    ----------
    rng : random.Random
    kind : str
        ``"numbers"`` (7 digits), ``"words"`` (adjective-noun) or ``"uuids"``.
    """
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(wordlist('adjective'))}-{rng.choice(wordlist('noun'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}; expected numbers, words or uuids")


def distinct_values(rng, kind, count, exclude=()):
    """``count`` random values of one kind, all different and none in ``exclude``."""
    taken = set(exclude)
    out = []
    while len(out) < count:
        value = random_value(rng, kind)
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out


@functools.cache
def zeta(alpha, terms=100_000):
    """Riemann zeta function for ``alpha > 1`` (partial sum plus integral tail)."""
    if alpha <= 1:
        raise ValueError(f"zeta needs alpha > 1, got {alpha}")
    head = sum(k**-alpha for k in range(1, terms + 1))
    return head + terms ** (1 - alpha) / (alpha - 1) - 0.5 * terms**-alpha
