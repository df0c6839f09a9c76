"""Variable tracking (vt): follow chains of ``VAR X = VAR Y`` assignments."""

import string

from restkv.bench.ruler.niah import NOISE
from restkv.bench.ruler.tasks import FAMILIES

MINIMUM_SIZE = 1
EXAMPLE_LENGTH = 500  # token budget of the worked example, as in RULER


def _names(rng, count, length):
    names = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=length))
        if name not in names:
            names.append(name)
    return names


def build(rng, size, num_chains, num_hops, name_length=5, example="", exclude=()):
    """One vt sample.

    Parameters
    ----------
    rng : random.Random
    size : int
        Number of noise paragraphs.
    num_chains, num_hops : int
        Chains inserted and assignments per chain after the first.
    name_length : int
        Letters per variable name (RULER uses 3 in the worked example).
    example : str
        Worked example put before the question, empty for none.
    exclude : iterable of str
        Values the chains must not start from (the example's value).

    Returns
    -------
    tuple of (str, str, list of str)
        Prompt, answer prefix, variables holding the queried value.
    """
    names = _names(rng, num_chains * (num_hops + 1), name_length)
    taken = set(exclude)
    starts = []
    while len(starts) < num_chains:
        value = str(rng.randint(10000, 99999))
        if value not in taken:
            taken.add(value)
            starts.append(value)
    chains = []
    for c, value in enumerate(starts):
        chain_vars = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        chains.append(
            (
                chain_vars,
                [f"VAR {chain_vars[0]} = {value}"]
                + [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(num_hops)],
            )
        )
    sentences = [NOISE + "\n"] * max(size, num_hops + 1)
    for _, lines in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(lines)))
        for j, position in enumerate(positions):
            sentences.insert(position + j, lines[j])
    context = " ".join(sentences).replace(". \n", ".\n")
    prompt = FAMILIES["vt"]["template"].format(context=context, query=starts[0])
    prefix = FAMILIES["vt"]["answer_prefix"].format(num_v=num_hops + 1, query=starts[0])
    return example + prompt, prefix, chains[0][0]
