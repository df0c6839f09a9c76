"""LongBench v2: the official prompt and answer extraction, the scores by difficulty and length, the runner on
fixture data (the official data.json schema) end to end."""

import json

import pytest

import eval_longbench_v2
import run_longbench_v2
from helpers import ROOT
from restkv.bench.longbench_v2.evaluate import evaluate
from restkv.bench.longbench_v2.run import load
from restkv.bench.longbench_v2.tasks import extract_answer, make_prompt, question_text

DATA = str(ROOT / "tests" / "bench" / "fixtures" / "longbench_v2")


def read(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_the_official_prompt():
    record = {"context": "  The text.\n", "question": " Who? ", "choice_A": "Ann", "choice_B": "Bo ", "choice_C": "Cy",
              "choice_D": "Di", "_id": "x"}
    assert make_prompt(record) == (
        "Please read the following text and answer the question below.\n\n<text>\nThe text.\n</text>\n\n"
        "What is the correct answer to this question: Who?\nChoices:\n(A) Ann\n(B) Bo\n(C) Cy\n(D) Di\n\n"
        "Format your response as follows: \"The correct answer is (insert answer here)\".")
    assert make_prompt(record).endswith(question_text(record))
    assert question_text(record).startswith("\n</text>\n\nWhat is the correct answer")


def test_a_placeholder_inside_the_context_stays():
    record = load(DATA)[2]
    assert "with $Q$ unchanged" in make_prompt(record)
    assert "question: For how many nights" in make_prompt(record)


@pytest.mark.parametrize("response, letter", [
    ("The correct answer is (B)", "B"),
    ("**The correct answer is (C)**", "C"),  # asterisks removed first
    ("The correct answer is D.", "D"),  # the second pattern
    ("I think the answer is A.", None),
    ("The correct answer is (E)", None),
    ("The correct answer is (A). Or rather, The correct answer is (B).", "A"),  # the first one counts
    ("the correct answer is (b)", None),  # case matters
])
def test_answer_extraction_as_pred_py(response, letter):
    assert extract_answer(response) == letter


def test_scores_overall_by_difficulty_and_by_length(tmp_path):
    folder = tmp_path / "m" / "longbench_v2"
    folder.mkdir(parents=True)
    rows = [("easy", "short", "A", "The correct answer is (A)"), ("hard", "short", "B", "The correct answer is (C)"),
            ("hard", "medium", "C", "The correct answer is C"), ("easy", "long", "D", "no idea"),
            ("hard", "long", "A", "**The correct answer is (A)**")]
    with open(folder / "fullkv.jsonl", "w", encoding="utf-8") as fh:
        for i, (difficulty, length, answer, pred) in enumerate(rows):
            fh.write(json.dumps({"_id": str(i), "difficulty": difficulty, "length": length, "answers": [answer],
                                 "pred": pred}) + "\n")
    table = evaluate(str(tmp_path))
    assert table[0] == ["label", "longbench_v2", "avg", "easy", "hard", "short", "medium", "long"]
    # right: 0, 2, 4 -> 60; easy 1 of 2, hard 2 of 3, short 1 of 2, medium 1 of 1, long 1 of 2
    assert table[1] == ["m/fullkv", 60.0, 60.0, 50.0, 66.67, 50.0, 100.0, 50.0]
    assert eval_longbench_v2.main(["--results_dir", str(tmp_path)]) == table


def test_records_lacking_official_fields_are_named(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps([{"_id": "a", "context": "c"}]), encoding="utf-8")
    with pytest.raises(ValueError, match="record 1 lacks fields"):
        load(str(tmp_path))


def test_records_keep_what_the_scores_group_by(tmp_path, monkeypatch):
    from restkv.bench import loop

    monkeypatch.setattr(loop, "decode_configs", lambda model, tok, prompts, configs, n, sweep=True: [
        (["The correct answer is (B)"] * len(prompts), None) for _ in configs])
    files = run_longbench_v2.main(["--data_dir", DATA, "--method", "fullkv", "--save_dir", str(tmp_path)])
    recs = read(files[("longbench_v2", "fullkv")])
    assert [(r["_id"], r["domain"], r["sub_domain"], r["difficulty"], r["length"], r["answers"]) for r in recs] == [
        ("fx-001", "Single-Document QA", "Literary", "easy", "short", ["B"]),
        ("fx-002", "Single-Document QA", "Literary", "hard", "medium", ["C"]),
        ("fx-003", "Long In-context Learning", "Puzzle", "hard", "long", ["A"])]
    assert evaluate(str(tmp_path))[1] == ["smollm2-135m/fullkv", 33.33, 33.33, 100.0, 0.0, 100.0, 0.0, 0.0]


@pytest.mark.slow
def test_end_to_end_on_smollm2(tmp_path):
    argv = ["--data_dir", DATA, "--method", "snapkv", "fullkv", "--max_capacity_prompts", "64", "--window_size", "8",
            "--max_new_tokens", "6", "--batch_size", "2"]
    files = run_longbench_v2.main(argv + ["--save_dir", str(tmp_path / "aware")])
    assert sorted(label for _, label in files) == ["fullkv", "snapkv_64-window_size=8"]
    recs = read(files[("longbench_v2", "fullkv")])
    assert [(r["_id"], r["answers"], r["difficulty"], r["length"]) for r in recs] == [
        ("fx-001", ["B"], "easy", "short"), ("fx-002", ["C"], "hard", "medium"), ("fx-003", ["A"], "hard", "long")]
    assert all(100 < r["prompt_tokens"] < 400 for r in recs)
    agnostic = run_longbench_v2.main(argv + ["--save_dir", str(tmp_path / "agnostic"), "--query_agnostic"])
    assert all(r["query_agnostic"] and r["question_start"] < r["prompt_tokens"]
               for r in read(agnostic[("longbench_v2", "snapkv_64-window_size=8")]))
    table = evaluate(str(tmp_path))
    assert len(table) == 5 and all(0.0 <= row[1] <= 100.0 for row in table[1:])


def test_a_max_length_too_short_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from restkv.bench import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["--data_dir", DATA, "--method", "fullkv", "--save_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        run_longbench_v2.main(argv + ["--max_length", "10"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "Traceback" not in err and "new tokens" not in last, err
    assert "--max_length 10 leaves no room for longbench_v2's prompts" in last and "chat template alone" in last
    assert not (tmp_path / "smollm2-135m").exists()
