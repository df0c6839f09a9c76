"""What a runner hands the loop: a :class:`Task` (its units, how to build a prompt and a record, its
:class:`~restkv.bench.store.Store`) and, per config and prompt, the :class:`Output` a record is made of."""

from dataclasses import dataclass, field
from typing import Callable

from .store import Store


QUESTION_START = (
    "the token holding the first character of the prompt template's text after its context "
    "(the chat template's closing tokens included), at most the prompt's last token"
)


@dataclass
class Output:
    """What one config generated for one prompt of a batch."""

    label: str
    kwargs: dict  # the config's ``restkv.configure`` kwargs
    text: str  # the continuation
    kept: list  # per layer, kept positions of the whole batch: LongTensor [batch, kv_heads, kept] or None
    row: int  # the prompt's row in the batch (in ``kept``)
    seconds: float  # decoding time of the batch per prompt and config


def _ids(prompt):
    return prompt


@dataclass
class Task:
    """One block of units to predict.

    Parameters
    ----------
    name : str
        Shown on its progress bar.
    units : list
        Its units of work, in the run's fixed order.
    prompt : callable
        ``prompt(unit)``: the built prompt, handed back to ``record``.
    record : callable
        ``record(unit, prompt, output) -> dict``: the record of one unit under one config (:class:`Output`).
    max_new_tokens : int
    store : Store
    ids : callable
        ``ids(prompt) -> list of int``: the token ids of a built prompt (default: the prompt itself).
    progress : dict
        Keyword arguments of its ``tqdm`` bar, besides ``desc``.
    announce : bool
        Print the number of records to run on stderr.
    question_start : callable, optional
        ``question_start(prompt) -> int``: the token of ``ids(prompt)`` where its question starts
        (:data:`QUESTION_START`); needed with ``--query_agnostic``.
    decode : callable, optional
        Decodes a batch in place of :func:`restkv.bench.generation.decode_configs` (same arguments, the
        prompts as ``ids`` gives them): e.g. several questions on one compressed context, whose
        ``Output.text`` is then the list of answers.
    """

    name: str
    units: list
    prompt: Callable
    record: Callable
    max_new_tokens: int
    store: Store
    ids: Callable = _ids
    progress: dict = field(default_factory=lambda: {"leave": False})
    announce: bool = False
    question_start: Callable | None = None
    decode: Callable | None = None
