"""LongBench end to end: fixture data in the official schema, runner, resume, evaluator."""

import csv
import json
import os

import pytest

import run_longbench
from restkv.bench import loop
from restkv.bench.longbench.data import load_records
from restkv.bench.longbench.evaluate import evaluate
from restkv.bench.longbench.run import make_task
from restkv.bench.longbench.tasks import DATASETS, LONGBENCH_E, PROMPTS
from helpers import fixture_record, write_fixture


def read(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_every_dataset_loads_and_fills_its_template(tmp_path):
    data = write_fixture(tmp_path / "data", DATASETS)
    for d in DATASETS:
        records = load_records(data, d)
        task = make_task(d, records)
        text = task.text(records[1], False)
        assert records[1]["context"] in text and "{" not in text, d
        assert (records[1]["input"] in text) == ("{input}" in PROMPTS[d]), d
        assert task.output(records[1])["_id"] == f"{d}-1"


def test_missing_and_malformed_data_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.zip"):
        load_records(str(tmp_path), "qasper")
    path = tmp_path / "qasper.jsonl"
    path.write_text(json.dumps(fixture_record("qasper", 0)) + "\n{broken\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{path}:2"):
        load_records(str(tmp_path), "qasper")


def test_malformed_prediction_line_is_reported_with_file_and_line(tmp_path):
    folder = tmp_path / "m" / "hotpotqa"
    folder.mkdir(parents=True)
    good = json.dumps({"_id": "a", "pred": "x", "answers": ["x"], "all_classes": None, "length": 1})
    (folder / "fullkv.jsonl").write_text(good + "\n" + good + "\n" + good[:-5] + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{folder / 'fullkv.jsonl'}:3"):
        evaluate(str(tmp_path))


def _fake_predictions(root, names, label, perfect):
    for name in names:
        dataset = name[:-2] if name.endswith("_e") else name
        folder = root / "model" / name
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{label}.jsonl", "w", encoding="utf-8") as fh:
            for i, length in enumerate((1000, 5000, 9000)):
                rec = fixture_record(dataset, i, length=length)
                pred = rec["answers"][0] if perfect or i == 0 else "zzz"
                fh.write(json.dumps({**rec, "pred": pred}, ensure_ascii=False) + "\n")


def test_evaluate_every_dataset_into_a_table(tmp_path, capsys):
    _fake_predictions(tmp_path, DATASETS, "good_128", perfect=True)
    _fake_predictions(tmp_path, DATASETS, "bad_128", perfect=False)
    table = evaluate(str(tmp_path))
    assert table[0] == ["label"] + DATASETS + ["avg"]
    rows = {row[0]: row[1:] for row in table[1:]}
    assert rows["model/good_128"] == [100.0] * 22
    assert rows["model/bad_128"] == [33.33] * 22  # first of three right
    with open(tmp_path / "results.csv", encoding="utf-8") as fh:
        assert list(csv.reader(fh))[1][0] == "model/bad_128"
    assert "model/good_128" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "model" / "qasper" / "metrics.json").read_text())
    assert metrics["bad_128"] == {"score": 33.33, "n": 3}


def test_evaluate_longbench_e_buckets(tmp_path):
    _fake_predictions(tmp_path, [f"{d}_e" for d in LONGBENCH_E], "m_64", perfect=False)
    table = evaluate(str(tmp_path), longbench_e=True)
    assert table[0][-4:] == ["avg", "0-4k", "4-8k", "8k+"]
    assert table[1][-4:] == [33.33, 100.0, 0.0, 0.0]
    assert os.path.exists(tmp_path / "results_e.csv")


ARGS = ["--max_new_tokens", "4", "--batch_size", "2", "--seed", "0"]


def test_end_to_end_on_smollm2(tmp_path, monkeypatch):
    data = write_fixture(tmp_path / "data", ["hotpotqa"], n=2, words=25)
    out = tmp_path / "out"
    kept, real_decode = [], loop.decode_configs

    def spy(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
        out = real_decode(model, tokenizer, prompts, configs, max_new_tokens, sweep)
        kept.append([None if k[0] is None else k[0].shape[-1] for _, k in out])
        return out

    monkeypatch.setattr(loop, "decode_configs", spy)
    files = run_longbench.main(["--data_dir", data, "--datasets", "hotpotqa", "--method", "restkv", "fullkv",
                                "--max_capacity_prompts", "64", "2048", "--save_dir", str(out)] + ARGS)
    assert [label for _, label in files] == ["restkv_64", "restkv_2048", "fullkv"]
    assert len(kept) == 1  # one batch, all configs on one prefill, each with its own budget
    assert kept[0][0] == 64 and kept[0][1] != 64 and kept[0][2] != 64
    preds = {label: read(path) for (_, label), path in files.items()}
    for label, recs in preds.items():
        assert [r["_id"] for r in recs] == ["hotpotqa-0", "hotpotqa-1"], label
        assert all(isinstance(r["pred"], str) and r["answers"] == ["the river Quell"] for r in recs)
        assert 200 < recs[0]["prompt_tokens"] < 2048
    # a budget above the prompt length evicts nothing
    assert [r["pred"] for r in preds["restkv_2048"]] == [r["pred"] for r in preds["fullkv"]]
    assert os.path.exists(out / "smollm2-135m" / "run_meta.json")
    table = evaluate(str(out))
    assert [row[0] for row in table[1:]] == ["smollm2-135m/fullkv", "smollm2-135m/restkv_2048",
                                             "smollm2-135m/restkv_64"]


def test_prompt_is_middle_truncated_to_max_length(tmp_path):
    data = write_fixture(tmp_path / "data", ["qasper"], n=1, words=60)
    files = run_longbench.main(["--data_dir", data, "--datasets", "qasper", "--method", "fullkv",
                                "--save_dir", str(tmp_path / "out"), "--max_length", "120",
                                "--chat_template", "off"] + ARGS)
    (rec,) = read(files[("qasper", "fullkv")])
    assert 115 <= rec["prompt_tokens"] <= 122


def test_interrupt_and_resume_keeps_each_record_once(tmp_path, monkeypatch):
    data = write_fixture(tmp_path / "data", ["triviaqa"], n=3, words=5)
    argv = ["--data_dir", data, "--datasets", "triviaqa", "--method", "fullkv", "--save_dir",
            str(tmp_path / "out"), "--max_new_tokens", "2"]
    state = {"calls": 0, "fail_on": 2}

    class Interrupted(Exception):
        pass

    def fake_decode(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
        state["calls"] += 1
        if state["calls"] == state["fail_on"]:
            raise Interrupted
        return [([f"pred{state['calls']}"] * len(prompts), None) for _ in configs]

    monkeypatch.setattr(loop, "decode_configs", fake_decode)
    with pytest.raises(Interrupted):
        run_longbench.main(argv)
    path = tmp_path / "out" / "smollm2-135m" / "triviaqa" / "fullkv.jsonl"
    assert [r["_id"] for r in read(path)] == ["triviaqa-0"]
    state.update(calls=0, fail_on=None)
    run_longbench.main(argv)
    assert state["calls"] == 2
    recs = read(path)
    assert [r["_id"] for r in recs] == ["triviaqa-0", "triviaqa-1", "triviaqa-2"]
    assert [r["pred"] for r in recs] == ["pred1", "pred1", "pred2"]
    state.update(calls=0)
    run_longbench.main(argv)
    assert state["calls"] == 0 and len(read(path)) == 3
