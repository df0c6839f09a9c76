"""Frequent words extraction (fwe): name the most frequent coded words (Zipf counts)."""

import string

from restkv.bench.ruler.sources import zeta
from restkv.bench.ruler.tasks import FAMILIES

WORD_LENGTH = 6
NOISE_WORD = "..."


def vocab_size(max_seq_length):
    """Coded vocabulary size RULER uses for a requested length."""
    return max(5, max_seq_length // 50)


def counts(size, alpha, vocab):
    """Occurrences of each vocabulary rank: ``int(size * k**-alpha / zeta(alpha))``."""
    return [int(size * k**-alpha / zeta(alpha)) for k in range(1, vocab + 1)]


def build(rng, size, max_seq_length, alpha):
    """One fwe sample.

    Parameters
    ----------
    rng : random.Random
    size : int
        Zipf total: rank ``k`` appears ``int(size * k**-alpha / zeta(alpha))`` times.
    max_seq_length : int
        Requested length (sets the vocabulary size).
    alpha : float
        Zipf exponent.

    Returns
    -------
    tuple of (str, str, list of str)
        Prompt, answer prefix, the three most frequent coded words (ranks 2-4;
        rank 1 is the ``...`` noise word).
    """
    vocab = set()
    while len(vocab) < vocab_size(max_seq_length):
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=WORD_LENGTH)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = NOISE_WORD
    text = [w for w, c in zip(vocab, counts(size, alpha, len(vocab))) for _ in range(c)]
    rng.shuffle(text)
    prompt = FAMILIES["fwe"]["template"].format(context=" ".join(text))
    return prompt, FAMILIES["fwe"]["answer_prefix"], vocab[1:4]
