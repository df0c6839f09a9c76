"""InfiniteBench task tables: tasks, prompt templates, generation lengths, answers.

Templates are those of the official ``src/prompt.py``: the ``chat`` set is the
instruction-style one written for chat models (``gpt4_templates``), the
``base`` set ends each prompt with an answer cue for base models
(``yarn_mistral_templates``). Records follow the released JSONL schema
``{"id", "context", "input", "answer", "options"}``.
"""

import re

TASKS = [
    "passkey",
    "number_string",
    "kv_retrieval",
    "longbook_sum_eng",
    "longbook_choice_eng",
    "longbook_qa_eng",
    "longbook_qa_chn",
    "longdialogue_qa_eng",
    "math_find",
    "math_calc",
    "code_run",
    "code_debug",
]
"""The 12 InfiniteBench tasks; each is read from ``<data_dir>/<task>.jsonl``."""

MAX_NEW_TOKENS = {
    "passkey": 6,
    "number_string": 12,
    "kv_retrieval": 50,
    "longbook_sum_eng": 1200,
    "longbook_choice_eng": 40,
    "longbook_qa_eng": 40,
    "longbook_qa_chn": 40,
    "longdialogue_qa_eng": 40,
    "math_find": 3,
    "math_calc": 30000,
    "code_run": 5,
    "code_debug": 5,
}
"""Official number of new tokens per task."""

_KV = "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}"
_OPTIONS = "A. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"
_MASK_INTRO = (
    "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", "
    "and you should try to guess who that character is.\n\n"
)

TEMPLATES = {
    "chat": {
        "passkey": (
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will "
            "quiz you about the important information there.\n\n{context}\n\n{input}"
        ),
        "number_string": (
            "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the "
            "important information there.\n\n{context}\n\n{input}"
        ),
        "kv_retrieval": _KV,
        "longbook_sum_eng": "Summarize the following book.\n\n{context}",
        "longbook_choice_eng": (
            "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n\nOnly one of the "
            "following options is correct, tell me the answer using one single letter (A, B, C, or D). Don't say "
            "anything else.\n" + _OPTIONS
        ),
        "longbook_qa_eng": (
            "Read the book below and answer a question.\n\n{context}\n\nQuestion: {question}\n\nBe very concise."
        ),
        "longbook_qa_chn": "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{question}\n请尽量简短地回答。",
        "longdialogue_qa_eng": (
            _MASK_INTRO
            + "The dialogue:\n\n---\n\n{context}\n\n---\n\nEnd of dialogue.\n\nWhich character is most "
            "likely \"$$MASK$$\"? Just say the name used by the scriptwriter (before the colon marks) of one single "
            "character and nothing else."
        ),
        "math_find": "{prefix}\n\n{context}\n\n{input}",
        "math_calc": "Compute the intermediate values in the following long expression.\n\n{context}",
        "code_run": (
            "Following is a set of Python functions. There is a function called named {func}.\n\n{context}\n\n"
            "Please give me the exact number of the return value of {func_call}. Be concise. Your response must "
            "end with the final returned value."
        ),
        "code_debug": (
            "There is ONLY ONE function in the large project that is deliberately made to include an obvious error. "
            "Please find the function that contains the most obvious errors. I will give you four options to narrow "
            "your scope. You can inspect the options and think. Eventually, tell me the answer using one single "
            "letter (A, B, C, or D).\n\n{context}\n\nWhich funtion has deliberate error?\n"
            + _OPTIONS
            + "\n\nYou "
            "should first find the functions in the options. Repeat their content, inspect through code, and at "
            "last give me your answer for the function that has the deliberate and obvious error in A, B, C, or D."
        ),
    },
    "base": {
        "passkey": (
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will "
            "quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is"
        ),
        "number_string": (
            "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the "
            "important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is"
        ),
        "kv_retrieval": _KV,
        "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
        "longbook_choice_eng": (
            "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n"
            + _OPTIONS
            + "\n\nThe letter of the correct answer is"
        ),
        "longbook_qa_eng": (
            "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
            "Question: {question}\nAnswer:"
        ),
        "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
        "longdialogue_qa_eng": _MASK_INTRO
        + "{context}\n\nThe name that has been replaced with $$MASK$$ is likely",
        "math_find": "{prefix}\n\n{context}\n\n{input}",
        "math_calc": (
            "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: "
            "[1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:"
        ),
        "code_run": (
            "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the "
            "exact value of {func_call}. The value of {func_call} is"
        ),
        "code_debug": (
            "Following is a Python code where exactly one of the functions/methods has a deliberate error that "
            "makes it crash.\n\n{context}\n\nOptions:\n" + _OPTIONS + "\n\nThe correct option is:"
        ),
    },
}
"""Official templates per style (``chat`` or ``base``) and task."""

CHOICE_TASKS = frozenset({"longbook_choice_eng", "code_debug"})


def fields(record, task):
    """Values that fill ``task``'s template for one record.

    Parameters
    ----------
    record : dict
        One record of ``<task>.jsonl``.
    task : str
        Task name.

    Returns
    -------
    dict
        Keyword arguments for ``TEMPLATES[style][task].format``.
    """
    out = {
        "context": record["context"],
        "input": record.get("input", ""),
        "question": record.get("input", ""),
    }
    if task in CHOICE_TASKS:
        out.update({f"OPTION_{c}": o for c, o in zip("ABCD", record["options"])})
    if task == "code_run":
        calls = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", record["input"])
        if not calls:
            raise ValueError(f"code_run record {record.get('id')}: no func_N(x) call in its input")
        out["func_call"] = calls[0]
        out["func"] = calls[0].split("(")[0]
    if task == "math_find":
        target = re.findall(r"The \w+ number", record["input"])
        if not target:
            raise ValueError(
                f"math_find record {record.get('id')}: no 'The <word> number' in its input"
            )
        out["prefix"] = f"What is {target[0].lower()} in the following list?"
    return out


def make_prompt(record, task, style="chat"):
    """Fill the official template of ``task`` (``style`` ``chat`` or ``base``) with ``record``."""
    return TEMPLATES[style][task].format(**fields(record, task))


def question_text(record, task, style="chat"):
    """The end of ``make_prompt(record, task, style)`` that is its question: the template's text after
    the context (empty for the summaries' chat template, which ends with the book)."""
    return TEMPLATES[style][task].split("{context}", 1)[1].format(**fields(record, task))


def answers(record, task):
    """Reference answers of a record as a list.

    For the multiple-choice tasks the list is ``[option text, option letter]``,
    the label form the official scorers expect.
    """
    ans = record["answer"]
    ans = list(ans) if isinstance(ans, (list, tuple)) else [ans]
    if task in CHOICE_TASKS and not (len(ans) == 2 and ans[1] in ("A", "B", "C", "D")):
        ans = [ans[0], "ABCD"[record["options"].index(ans[0])]]
    return ans
