"""InfiniteBench scorers and prompts against hand-computed values."""

import pytest

from restkv.bench.infinitebench import metrics as m
from restkv.bench.infinitebench.tasks import MAX_NEW_TOKENS, TASKS, TEMPLATES, answers, make_prompt


def test_retrieval_scorers():
    assert m.passkey("The pass key is 71432.", ["71432"]) == 1.0
    assert m.passkey("7 1432", ["71432"]) == 0.0
    assert m.number_string("digits: 0123456789 and 5", ["0123456789"]) == 1.0
    assert m.kv_retrieval('The value is "a1b2-c3".', ["a1b2-c3"]) == 1.0
    assert m.kv_retrieval("The value is a1b2", ["a1b2-c3"]) == 0.0


def test_code_scorers():
    assert m.code_run("The value is: 42", ["42"]) == 1.0
    assert m.code_run("42 is the value", ["42"]) == 0.0
    assert m.code_run("", ["42"]) == 0.0
    assert m.code_debug("B. func_x", ["func_x", "B"]) == 1.0
    assert m.code_debug("So the answer is: func_x", ["func_x", "B"]) == 1.0
    assert m.code_debug("So the answer is: C", ["func_x", "B"]) == 0.0
    assert m.code_debug("no prefix here B", ["func_x", "B"]) == 0.0


def test_choice_and_dialogue():
    assert m.longbook_choice_eng("B", ["some option", "B"]) == 1.0
    assert m.longbook_choice_eng("C", ["some option", "B"]) == 0.0
    assert m.longbook_choice_eng("I think the answer is B", ["some option", "B"]) == 1.0
    assert m.longbook_choice_eng("It must be option D then", ["x", "D"]) == 1.0
    assert m.longbook_choice_eng("", ["x", "D"]) == 0.0
    assert m.longdialogue_qa_eng("I think it is Hamlet.", ["HAMLET"]) == 1.0
    assert m.longdialogue_qa_eng("Ophelia", ["HAMLET"]) == 0.0


def test_math_scorers():
    assert m.math_find("The answer is 17", ["17"]) == 1.0
    assert m.math_find("3.5 is it", ["3.5"]) == 1.0
    assert m.math_find("3.5 is it", ["3"]) == 0.0
    # 1, 4 right, then 9 != 8 stops the count: 2 of 4
    assert m.math_calc("[1, 4, 9, 3]", [1, 4, 8, 3]) == 0.5


def test_text_scorers():
    # character F1: 北 京 市 vs 北 京 -> p = 2/3, r = 1 -> 0.8
    assert m.longbook_qa_chn("北京市。", ["北京"]) == pytest.approx(0.8)
    assert m.longbook_qa_eng("the Red House", ["green house", "red house"]) == 1.0
    # ROUGE-Lsum: LCS 3, p = 1, r = 1/2 -> 2/3
    assert m.longbook_sum_eng("the cat sat", ["the cat sat on the mat"]) == pytest.approx(2 / 3)
    assert m.score_record("passkey", "12", ["12"]) == 1.0


def _record(task):
    rec = {"id": 3, "context": "CTX", "input": "INP", "answer": ["x"], "options": []}
    if task == "code_run":
        rec["input"] = "Please give me the exact number of the return value of func_12(-3)."
    if task == "math_find":
        rec["input"] = "The largest number of the list is: "
    if task in ("code_debug", "longbook_choice_eng"):
        rec.update(options=["o1", "o2", "o3", "o4"], answer=["o3"])
    return rec


@pytest.mark.parametrize("style", ["chat", "base"])
def test_every_template_fills(style):
    assert set(TEMPLATES[style]) == set(TASKS) == set(MAX_NEW_TOKENS)
    for task in TASKS:
        prompt = make_prompt(_record(task), task, style)
        assert "CTX" in prompt and "{" not in prompt, task


def test_prompt_fields_and_answers():
    code = make_prompt(_record("code_run"), "code_run", "base")
    assert "There is a function called func_12 in" in code and code.endswith("The value of func_12(-3) is")
    find = make_prompt(_record("math_find"), "math_find", "chat")
    assert find.startswith("What is the largest number in the following list?\n\nCTX\n\nThe largest")
    choice = make_prompt(_record("longbook_choice_eng"), "longbook_choice_eng", "chat")
    assert choice.endswith("A. o1\nB. o2\nC. o3\nD. o4") and "Question: INP" in choice
    assert answers(_record("code_debug"), "code_debug") == ["o3", "C"]
    assert answers({"answer": "7"}, "passkey") == ["7"]
    assert MAX_NEW_TOKENS["passkey"] == 6 and MAX_NEW_TOKENS["longbook_sum_eng"] == 1200
