"""The math data sets: where each comes from, its fields, the prompt and the generation length.

The prompt is the one reasoning models are evaluated with (DeepSeek-R1's and Qwen2.5-Math's chain-of-thought
instruction) for every set, GSM8K included: the problem, then "Please reason step by step, and put your final
answer within \\boxed{}.", as one user turn of the chat template when the tokenizer has one.
"""

from __future__ import annotations

from ..hubdata import Source

SOURCES = {
    "math500": Source("math500", "HuggingFaceH4/MATH-500", split="test"),
    "aime24": Source("aime24", "HuggingFaceH4/aime_2024", split="train"),
    "aime25": Source("aime25", "math-ai/aime25", split="test"),
    "gsm8k": Source("gsm8k", "openai/gsm8k", config="main", split="test"),
}
"""The reference copy of each data set (any copy with the fields below works: ``--data_dir``)."""

DATASETS = list(SOURCES)

PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."

MAX_NEW_TOKENS = 32768
"""Tokens generated per problem unless ``--max_new_tokens`` says otherwise: the reasoning models' budget
(R-KV's and kvpress's AIME runs generate up to 32K tokens)."""

FIELDS = {
    "problem": ("problem", "question", "Problem", "Question"),
    "answer": ("answer", "Answer", "expected_answer"),
    "id": ("unique_id", "id", "ID", "problem_idx", "idx"),
}
"""Each field read, and the names different copies give it (the first found is used)."""


def record(dataset: str, raw: dict, index: int, where: str) -> dict:
    """A data set's record in this runner's form: ``id`` (its own id, else ``<dataset>-<index>``), ``problem``,
    ``answer`` (GSM8K: the text after "#### " of the reference solution).

    Raises
    ------
    ValueError
        A record without a problem or an answer field (naming ``where`` and the record).
    """
    out = {}
    for name, aliases in FIELDS.items():
        found = next((raw[a] for a in aliases if raw.get(a) is not None), None)
        if found is None and name != "id":
            raise ValueError(f"{where}: record {index + 1} has none of the fields {', '.join(aliases)}")
        out[name] = found
    out["id"] = str(out["id"]) if out["id"] is not None else f"{dataset}-{index}"
    answer = str(out["answer"])
    if dataset == "gsm8k":
        if "####" not in answer:
            raise ValueError(f"{where}: record {index + 1}'s answer has no '#### <number>' line (GSM8K's format)")
        answer = answer.split("####")[-1]
    out["answer"] = answer.strip()
    return out
