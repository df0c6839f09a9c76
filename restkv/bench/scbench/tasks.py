"""SCBench (microsoft/SCBench) tasks run here, in its "same context, different query" mode: each record's context
is compressed once per config and each of its questions (``multi_turns``) is answered on it.

Templates, generation lengths and references are those of SCBench's ``eval_utils.py`` (``create_scdq_prompt``,
``DATA_NAME_TO_MAX_NEW_TOKENS``, ``get_ground_truth``): the context part of the template, then each question
right after it (the same text in a chat template's user turn when the tokenizer has one).

Left out: ``scbench_repoqa`` and ``scbench_repoqa_and_kv`` (scored by RepoQA's code-similarity pass@1, a
separate toolchain), and ``scbench_summary_with_needles`` (its turns mix two tasks with different generation
lengths, 800 and 15 tokens, where a run here has one per task).
"""

from __future__ import annotations

import re

from ..hubdata import Source

_CHOICE = (
    "Question: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe the correct answer is"
)

CONTEXT = {
    "scbench_kv": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}",
    "scbench_prefix_suffix": "{context}",
    "scbench_vt": "{context}",
    "scbench_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}",
    "scbench_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}",
    "scbench_choice_eng": "Read the book and answer the question.\n\n{context}",
    "scbench_many_shot": "{context}",
    "scbench_mf": "{prefix}\n\n{context}",
    "scbench_summary": "{context}",
}
"""The context part of each task's template (SCBench's ``multiturn_templates_scdq``), verbatim."""

QUESTION = {
    "scbench_choice_eng": _CHOICE,
    "scbench_qa_eng": "Question: {question}\nAnswer:",
    "scbench_qa_chn": "问题：{question}\n答案：",
    "scbench_mf": "{prefix}\n\n{input}",
}
"""The question part where it is not the turn's ``input`` itself, verbatim (``The the`` included)."""

TASKS = list(CONTEXT)

MAX_NEW_TOKENS = {
    "scbench_kv": 150,
    "scbench_prefix_suffix": 150,
    "scbench_vt": 30,
    "scbench_qa_eng": 40,
    "scbench_qa_chn": 40,
    "scbench_choice_eng": 40,
    "scbench_many_shot": 10,
    "scbench_mf": 5,
    "scbench_summary": 200,
}

SOURCES = {
    t: Source(t, "microsoft/SCBench", config=t, split="test", stems=(t, t.replace("scbench_", "multi_turn_")),
              own_folder=False)
    for t in TASKS
}
"""Each task's config of the hub copy; locally ``<task>.jsonl`` (SCBench's own data folder) or the earlier
``multi_turn_<name>.jsonl``, a ``<task>/`` folder, or a snapshot of the hub repository."""


def _context(record):
    return record["context"] if "context" in record else record["input"]


def _mf_prefix(question):
    """SCBench's question of a scbench_mf turn: "What is <the ... >?" from its "The ... is" sentence."""
    found = re.findall(r"The .+ is", question)
    if not found:
        raise ValueError(f"scbench_mf: no 'The ... is' in the question {question[:60]!r}")
    return f"What is {found[0].lower()[:-3]}?"


def question(task, turn):
    """The text of one question of ``task``."""
    if task == "scbench_choice_eng":
        options = {f"OPTION_{c}": o for c, o in zip("ABCD", turn["options"])}
        return _CHOICE.format(question=turn["input"], **options)
    if task == "scbench_mf":
        return QUESTION[task].format(prefix=_mf_prefix(turn["input"]), input=turn["input"])
    return QUESTION.get(task, "{input}").format(question=turn["input"], input=turn["input"])


def turns(task, record):
    """``(context text, [question texts])`` of one record: the prompt pieces of a shared context."""
    prefix = record["multi_turns"][0]["input"] if task == "scbench_mf" else ""
    context = CONTEXT[task].format(context=_context(record), prefix=prefix)
    return context, [question(task, t) for t in record["multi_turns"]]


def references(task, record):
    """The reference of each question, as SCBench's ``get_ground_truth`` gives it (scbench_choice_eng: ``[option
    text, letter]``; scbench_qa_eng: ``[answer]``; the others the answer as stored)."""
    out = []
    for turn in record["multi_turns"]:
        if task == "scbench_choice_eng":
            out.append([turn["answer"], "ABCD"[list(turn["options"]).index(turn["answer"])]])
        elif task == "scbench_qa_eng":
            out.append([turn["answer"]])
        else:
            out.append(turn["answer"])
    return out
