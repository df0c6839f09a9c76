"""RULER task table: prompt templates, answer prefixes and per-task settings.

The templates, answer prefixes, generation lengths and task arguments follow
RULER (``scripts/data/synthetic/constants.py`` and ``scripts/synthetic.yaml``).
"""

import re

FAMILIES = {
    "niah": {
        "tokens_to_generate": 128,
        "metric": "string_match_all",
        "template": (
            "Some special magic {type_needle_v} are hidden within the following text. "
            "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n"
            "{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
        ),
        "answer_prefix": (
            " The special magic {type_needle_v} for {query} mentioned in the provided text are"
        ),
    },
    "vt": {
        "tokens_to_generate": 30,
        "metric": "string_match_all",
        "template": (
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            "{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above."
        ),
        "answer_prefix": (
            " Answer: According to the chain(s) of variable assignment in the text above, "
            "{num_v} variables are assgined the value {query}, they are: "
        ),
    },
    "cwe": {
        "tokens_to_generate": 120,
        "metric": "string_match_all",
        "template": (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n"
            "{context}\n"
            "Question: What are the 10 most common words in the above list?"
        ),
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "fwe": {
        "tokens_to_generate": 50,
        "metric": "string_match_all",
        "template": (
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. {context}\n"
            "Question: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text?"
        ),
        "answer_prefix": (
            " Answer: According to the coded text above, the three most frequently appeared words are:"
        ),
    },
    "qa": {
        "tokens_to_generate": 32,
        "metric": "string_match_part",
        "template": (
            "Answer the question based on the given documents. "
            "Only give me the answer and do not output any other words.\n\n"
            "The following are given documents.\n\n"
            "{context}\n\n"
            "Answer the question based on the given documents. "
            "Only give me the answer and do not output any other words.\n\n"
            "Question: {query}"
        ),
        "answer_prefix": " Answer:",
    },
}


def _niah(haystack, key, value, num_k=1, num_v=1, num_q=1):
    return (
        "niah",
        {
            "haystack": haystack,
            "key_type": key,
            "value_type": value,
            "num_k": num_k,
            "num_v": num_v,
            "num_q": num_q,
        },
    )


TASKS = {
    "niah_single_1": _niah("repeat", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", num_q=4),
    "vt": ("vt", {"num_chains": 1, "num_hops": 4}),
    "cwe": ("cwe", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": ("fwe", {"alpha": 2.0}),
    "qa_1": ("qa", {"dataset": "squad"}),
    "qa_2": ("qa", {"dataset": "hotpotqa"}),
}

SYNTHETIC = [name for name, (family, _) in TASKS.items() if family != "qa"]


def family_of(task):
    """Task family of a RULER task name.

    Parameters
    ----------
    task : str
        Task name, e.g. ``niah_single_1`` or a folder name from RULER's own scripts.

    Returns
    -------
    str
        One of the keys of ``FAMILIES``.
    """
    if task in TASKS:
        return TASKS[task][0]
    for prefix in ("niah", "qa"):
        if task.startswith(prefix + "_"):
            return prefix
    raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")


def task_order(tasks):
    """Sort task names: RULER's order first, unknown names after, alphabetically."""
    known = list(TASKS)
    return sorted(tasks, key=lambda t: (known.index(t) if t in known else len(known), t))


def question_offset(text, task):
    """Where the question of a RULER prompt ``text`` (a record's ``input``) starts: the last place from
    which the rest of ``text`` is the task family's template text after ``{context}`` (for niah also in
    RULER's singular wording of a single answer).

    Raises
    ------
    ValueError
        When ``text`` does not end with that template text (a prompt built from other templates).
    """
    family = family_of(task)
    after = FAMILIES[family]["template"].split("{context}", 1)[1]
    variants = [after]
    if family == "niah":
        variants.append(singular(after))
    found = [_last_match(text, variant) for variant in variants]
    if max(found) < 0:
        raise ValueError(f"{task}: the prompt does not end with its task's question template")
    return max(found)


def singular(text):
    """RULER's rewording of the question for a single answer."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


def _last_match(text, template):
    """The last start from which ``text`` ends as ``template`` (``{name}``: any text) does, or -1."""
    pieces = re.split(r"\{\w+\}", template)
    pattern = re.compile(".*?".join(re.escape(p) for p in pieces) + r"\Z", re.S)
    start = len(text)
    while (start := text.rfind(pieces[0], 0, start)) >= 0:
        if pattern.match(text, start):
            return start
    return -1
