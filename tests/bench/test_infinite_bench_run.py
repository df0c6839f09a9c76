"""InfiniteBench end to end: fixture data in the released schema, runner, evaluator."""

import json
import os

import pytest

import run_infinite_bench
from restkv.bench.infinitebench.data import load_records
from restkv.bench.infinitebench.evaluate import evaluate
from restkv.bench.infinitebench.run import make_task
from restkv.bench.infinitebench.tasks import TASKS
from helpers import passkey_record, write_passkey

PERFECT = {  # task: (answer field, options, a prediction that scores 1)
    "passkey": (["68432"], [], "68432"),
    "number_string": (["0123456789"], [], "0123456789"),
    "kv_retrieval": (["a1b2-c3d4"], [], "a1b2-c3d4"),
    "longbook_sum_eng": (["The book is about a river."], [], "The book is about a river."),
    "longbook_choice_eng": (["o3"], ["o1", "o2", "o3", "o4"], "C"),
    "longbook_qa_eng": (["the river Quell"], [], "river Quell"),
    "longbook_qa_chn": (["北京"], [], "北京"),
    "longdialogue_qa_eng": (["HAMLET"], [], "Hamlet"),
    "math_find": (["17"], [], "17"),
    "math_calc": ([1, 4, 8], [], "1, 4, 8"),
    "code_run": (["42"], [], "The value is 42"),
    "code_debug": (["func_b"], ["func_a", "func_b", "func_c", "func_d"], "B."),
}


def read(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_missing_and_malformed_data_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="xinrongzhang2022/InfiniteBench"):
        load_records(str(tmp_path), "passkey")
    path = tmp_path / "passkey.jsonl"
    path.write_text(json.dumps(passkey_record(0)) + "\n" + "not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{path}:2"):
        load_records(str(tmp_path), "passkey")


def test_evaluate_every_task_into_a_table(tmp_path):
    for label, good in (("good_1024", True), ("bad_1024", False)):
        for task, (answer, options, pred) in PERFECT.items():
            folder = tmp_path / "model" / task
            folder.mkdir(parents=True, exist_ok=True)
            task_obj = make_task(task, [])
            rec = {"id": 0, "context": "", "input": "", "answer": answer, "options": options}
            with open(folder / f"{label}.jsonl", "w", encoding="utf-8") as fh:
                for i in range(2):
                    out = task_obj.output({**rec, "id": i})
                    fh.write(json.dumps({**out, "pred": pred if good or i == 0 else "xyz"}) + "\n")
    table = evaluate(str(tmp_path))
    assert table[0] == ["label"] + TASKS + ["avg"]
    rows = {row[0]: row[1:] for row in table[1:]}
    assert rows["model/good_1024"] == [100.0] * 13
    assert rows["model/bad_1024"] == [50.0] * 13
    assert os.path.exists(tmp_path / "results_infinite.csv")


def test_end_to_end_on_smollm2(tmp_path):
    data = write_passkey(tmp_path / "data")
    out = tmp_path / "out"
    files = run_infinite_bench.main(["--data_dir", data, "--tasks", "passkey", "--method", "fullkv", "restkv",
                                     "--max_capacity_prompts", "64", "--batch_size", "2", "--save_dir", str(out)])
    assert sorted(label for _, label in files) == ["fullkv", "restkv_64"]
    for path in files.values():
        recs = read(path)
        assert [r["id"] for r in recs] == [0, 1]
        assert [r["answers"] for r in recs] == [["50000"], ["51111"]]
        assert all(150 < r["prompt_tokens"] < 1000 for r in recs)
    meta = json.loads((out / "smollm2-135m" / "run_meta.json").read_text())
    assert meta["benchmark"] == "infinite_bench" and meta["labels"] == ["fullkv", "restkv_64"]
    table = evaluate(str(out))
    assert [row[0] for row in table[1:]] == ["smollm2-135m/fullkv", "smollm2-135m/restkv_64"]
    assert all(0.0 <= row[1] <= 100.0 for row in table[1:])
