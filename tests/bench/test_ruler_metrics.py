"""RULER scoring on hand-made predictions, and the results table."""

import csv
import json

import pytest

from restkv.bench.ruler.evaluate import evaluate
from restkv.bench.ruler.metrics import match_all, match_part, postprocess, score


def test_match_all_counts_each_reference():
    assert match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert match_all("only 1234567 here", ["1234567", "7654321"]) == 0.5
    assert match_all("Nothing", ["a1", "b2", "c3", "d4"]) == 0.0
    assert match_all("APPLE, Banana", ["apple", "banana", "cherry", "date"]) == 0.5


def test_match_part_needs_one_reference():
    assert match_part("It was Paris, France.", ["paris", "Lyon"]) == 1.0
    assert match_part("It was Rome.", ["Paris", "Lyon"]) == 0.0


def test_score_is_a_mean_times_100_after_postprocessing():
    preds = ["\x00 1234567\x07", "7654321", "none"]
    refs = [["1234567"], ["7654321", "1111111"], ["2222222"]]
    assert score(preds, refs, "string_match_all") == pytest.approx(100 * (1 + 0.5 + 0) / 3)
    assert score(preds, refs, "string_match_part") == pytest.approx(100 * 2 / 3)
    assert postprocess("  a\tb\x01c  ") == "a\nb\nc"
    with pytest.raises(ValueError, match="as many predictions"):
        score(["a"], [], "string_match_all")


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _rec(task, method, pred, outputs, length=4096, model="m"):
    return {"task": task, "method": method, "max_seq_length": length, "pred": pred,
            "outputs": outputs, "model": model, "index": 0}


def test_table_rows_come_from_the_data(tmp_path, capsys):
    root = tmp_path / "res"
    _write(root / "m/4096/vt/fullkv.jsonl", [_rec("vt", "fullkv", "A B C D E", list("ABCDE"))])
    _write(root / "m/4096/qa_2/fullkv.jsonl", [_rec("qa_2", "fullkv", "Paris", ["paris", "x"])])
    _write(root / "m/4096/vt/snapkv_1024.jsonl", [_rec("vt", "snapkv_1024", "A B", list("ABCDE"))])
    _write(root / "m/4096/vt/snapkv_128.jsonl", [_rec("vt", "snapkv_128", "", list("ABCDE"))])
    _write(root / "m/8192/vt/fullkv.jsonl", [_rec("vt", "fullkv", "A", list("ABCDE"), length=8192)])
    header, rows = evaluate(root, tmp_path / "t.csv")
    assert header == ["model", "context_length", "method", "samples", "vt", "qa_2", "avg"]
    assert [r[1:3] for r in rows] == [[4096, "fullkv"], [4096, "snapkv_128"], [4096, "snapkv_1024"],
                                      [8192, "fullkv"]]
    assert rows[0][4:] == [100.0, 100.0, 100.0]
    assert rows[2][4:] == [40.0, "", 40.0] and rows[3][4:] == [20.0, "", 20.0]
    with open(tmp_path / "t.csv") as fh:
        assert list(csv.reader(fh))[1] == ["m", "4096", "fullkv", "1", "100.0", "100.0", "100.0"]
    assert "snapkv_1024" in capsys.readouterr().out


def test_prediction_without_a_field_names_file_and_record(tmp_path):
    rec = _rec("vt", "fullkv", "A", ["A"])
    del rec["outputs"]
    path = tmp_path / "m/4096/vt/fullkv.jsonl"
    _write(path, [_rec("vt", "fullkv", "A", ["A"]), rec])
    with pytest.raises(ValueError, match=f"{path} record 2: missing field\\(s\\) \\['outputs'\\]"):
        evaluate(tmp_path)
