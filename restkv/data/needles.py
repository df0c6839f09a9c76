"""Needle prompts: the needles, the haystack, and one prompt per (needle, length, depth) cell."""

import random
from dataclasses import dataclass
from pathlib import Path


from .prompts import build_prompt, encode, middle_truncate, split_prompt

PROMPT = (
    "You are a helpful AI bot that answers questions for a user. Keep your response short and direct.\n\n"
    "<document>\n{context}\n</document>\n\n"
    "Question: {question} Don't give information outside the document or repeat your findings.\nAnswer:"
)


@dataclass(frozen=True)
class Needle:
    """A needle, its question and expected answer; ``{key}`` in ``text`` and ``answer`` is a per-case number."""

    name: str
    text: str
    question: str
    answer: str

    def fill(self, key):
        """``(needle text, answer)`` with ``{key}`` replaced."""
        return self.text.format(key=key).strip(), self.answer.format(key=key).strip()


NEEDLES = {
    "sf": Needle(
        "sf",
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
        "What is the best thing to do in San Francisco?",
        "eat a sandwich and sit in Dolores Park on a sunny day",
    ),
    "passkey": Needle(
        "passkey",
        "The pass key is {key}. Remember it. {key} is the pass key.",
        "What is the pass key?",
        "{key}",
    ),
}


class Haystack:
    """Token ids of the concatenated ``.txt`` files of a folder (sorted by name, cycled when too short).

    Raises
    ------
    FileNotFoundError
        The folder does not exist or holds no ``.txt`` file.
    """

    def __init__(self, tokenizer, folder):
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"haystack folder {folder} does not exist")
        self.files = sorted(folder.glob("*.txt"))
        if not self.files:
            raise FileNotFoundError(f"haystack folder {folder} holds no .txt file")
        self.folder = folder
        self.tokenizer = tokenizer
        self._ids = []
        self._read = 0
        self._boundary = {}

    def ids(self, n):
        """The first ``n`` token ids."""
        while len(self._ids) < n:
            text = self.files[self._read % len(self.files)].read_text(
                encoding="utf-8", errors="replace"
            )
            self._ids += self.tokenizer(text.strip() + "\n\n", add_special_tokens=False).input_ids
            self._read += 1
        return self._ids[:n]

    def is_boundary(self, token_id):
        """Whether a token ends a sentence (its text ends with ``.``, ``!`` or ``?``)."""
        if token_id not in self._boundary:
            self._boundary[token_id] = (
                self.tokenizer.decode([token_id]).rstrip().endswith((".", "!", "?"))
            )
        return self._boundary[token_id]


def insert_needle(context, needle, depth, is_boundary):
    """Insert ``needle`` into ``context`` (token id lists) at ``depth`` percent.

    The insertion point moves back to just after the nearest sentence end;
    ``depth >= 100`` appends at the end.

    Returns
    -------
    (list of int, int)
        The new ids and the needle's first index.
    """
    if depth >= 100:
        pos = len(context)
    else:
        pos = int(len(context) * depth / 100)
        while pos > 0 and not is_boundary(context[pos - 1]):
            pos -= 1
    return context[:pos] + needle + context[pos:], pos


@dataclass
class Case:
    """One prompt: its token ids, where the needle lies in them, and what the answer should be."""

    ids: list
    needle_text: str
    answer: str
    needle_span: tuple  # [start, end) token positions in ``ids``, None if truncated away
    truncated: bool
    question_start: int = (
        None  # the token of ``ids`` where the question starts (PROMPT's text after {context})
    )


def passkey(seed, length, depth):
    """The 5-digit key of one (length, depth) cell: the same for every method."""
    return random.Random(f"{seed}:{length}:{depth}").randint(10000, 99999)


def make_case(
    tokenizer, haystack, needle, length, depth, chat_template="auto", max_length=None, seed=0
):
    """Build the prompt of one (needle, length, depth) cell.

    ``length`` is the prompt's total size in tokens (template, question and
    needle included); the haystack fills what is left. Prompts longer than
    ``max_length`` are truncated in the middle.
    """
    needle_text, answer = needle.fill(passkey(seed, length, depth))
    needle_ids = tokenizer("\n" + needle_text + "\n", add_special_tokens=False).input_ids
    shell = build_prompt(
        tokenizer, PROMPT.format(context="", question=needle.question), chat_template
    )
    room = length - len(encode(tokenizer, shell)) - len(needle_ids)
    if room < 1:
        raise ValueError(f"context length {length} leaves no room for the haystack")
    ctx, _ = insert_needle(haystack.ids(room), needle_ids, depth, haystack.is_boundary)
    context = tokenizer.decode(ctx)
    prompt = build_prompt(
        tokenizer, PROMPT.format(context=context, question=needle.question), chat_template
    )
    ids, offsets = encode(tokenizer, prompt, offsets=True)
    c0 = prompt.find(needle_text, prompt.find("<document>"))
    c1 = c0 + len(needle_text)
    inside = [i for i, (a, b) in enumerate(offsets) if b > a and a < c1 and b > c0]
    span = (inside[0], inside[-1] + 1)
    after = PROMPT.split("{context}")[1].format(
        question=needle.question
    )  # the question: the text after the context
    question = split_prompt(tokenizer, prompt, prompt.rfind(after))[1]
    truncated = bool(max_length) and len(ids) > max_length
    if truncated:
        head = (max_length + 1) // 2
        cut = len(ids) - max_length // 2
        moved = [p if p < head else p - cut + head for p in range(*span) if p < head or p >= cut]
        ids = middle_truncate(ids, max_length)
        span = (moved[0], moved[-1] + 1) if moved else None
        question = question if question < head else max(head, question - cut + head)
    return Case(ids, needle_text, answer, span, truncated, question)
