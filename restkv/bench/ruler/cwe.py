"""Common words extraction (cwe): name the words repeated most in a numbered list."""

from restkv.bench.ruler.sources import common_words
from restkv.bench.ruler.tasks import FAMILIES

SHORT_CONTEXT = 4096  # below this RULER uses fewer repetitions


def repeats(max_seq_length, freq_cw, freq_ucw):
    """(common, uncommon) repetitions of the question list and of the worked example."""
    if max_seq_length < SHORT_CONTEXT:
        return (6, 1), (20, 3, 1)
    return (freq_cw, freq_ucw), (40, 10, 3)


def minimum_size(num_cw):
    """Smallest number of distinct words in the question list."""
    return num_cw + 1


def maximum_size(max_seq_length):
    """Largest number of distinct words the vocabulary allows (the example takes some)."""
    return len(common_words()) - repeats(max_seq_length, 0, 0)[1][0]


def _numbered(words):
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _listing(rng, words, num_cw, common, uncommon):
    items = words[:num_cw] * common + words[num_cw:] * uncommon
    rng.shuffle(items)
    return _numbered(items)


def build(rng, size, max_seq_length, freq_cw, freq_ucw, num_cw):
    """One cwe sample.

    Parameters
    ----------
    rng : random.Random
    size : int
        Distinct words in the question list (``num_cw`` of them are the common ones).
    max_seq_length : int
        Requested length; below 4096 the repetitions are reduced, as in RULER.
    freq_cw, freq_ucw, num_cw : int
        Repetitions of common and uncommon words, number of common words.

    Returns
    -------
    tuple of (str, str, list of str)
        Prompt (worked example, then the question), answer prefix, common words.
    """
    (common, uncommon), (ex_words, ex_common, ex_uncommon) = repeats(
        max_seq_length, freq_cw, freq_ucw
    )
    if size + ex_words > len(common_words()):
        raise ValueError(f"cwe: {size} words requested, the vocabulary has {len(common_words())}")
    picked = rng.sample(common_words(), ex_words + size)
    example_words = picked[:ex_words]
    words = picked[ex_words:]
    template = FAMILIES["cwe"]["template"]
    prefix = FAMILIES["cwe"]["answer_prefix"]
    example = (
        template.format(context=_listing(rng, example_words, num_cw, ex_common, ex_uncommon))
        + prefix
        + " "
        + _numbered(example_words[:num_cw])
    )
    question = template.format(context=_listing(rng, words, num_cw, common, uncommon))
    return example + "\n" + question, prefix, words[:num_cw]
