"""The math runner end to end: fixture data in each set's hub schema, the data's own solutions graded right,
the runner on the packaged model with eviction while decoding, resume, the evaluator, one-line errors."""

import json

import datasets
import pytest

import eval_math
import run_math
from helpers import ROOT
from restkv.bench import loop, models
from restkv.bench.reasoning.evaluate import evaluate
from restkv.bench.reasoning.run import load
from restkv.bench.reasoning.tasks import DATASETS

DATA = str(ROOT / "tests" / "bench" / "fixtures" / "math")


def read(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_each_set_loads_in_its_hub_schema():
    got = {d: load(d, DATA) for d in DATASETS}
    assert [r["id"] for r in got["math500"]][0] == "test/prealgebra/fixture-1.json"
    assert [r["answer"] for r in got["math500"]] == [r"\frac{7}{8}", "8", "(3,2)"]
    assert [(r["id"], r["answer"]) for r in got["aime24"]] == [("60", "24"), ("61", "24")]
    assert [(r["id"], r["answer"]) for r in got["aime25"]] == [("0", "77"), ("1", "391")]
    assert [(r["id"], r["answer"]) for r in got["gsm8k"]] == [("gsm8k-0", "6"), ("gsm8k-1", "90"),
                                                            ("gsm8k-2", "2,500")]
    assert got["gsm8k"][0]["problem"].startswith("A baker makes 24 rolls")
    assert load("gsm8k", DATA, limit=1) == got["gsm8k"][:1]


def test_bad_records_are_named(tmp_path):
    (tmp_path / "aime25.jsonl").write_text('{"question": "x", "solution": "y"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="record 1 has none of the fields answer, Answer"):
        load("aime25", str(tmp_path))
    (tmp_path / "gsm8k.jsonl").write_text('{"question": "x", "answer": "42"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="has no '#### <number>' line"):
        load("gsm8k", str(tmp_path))


def _predictions(root, label, right):
    """Prediction files whose outputs are the data's own reference solutions (right) or a wrong number."""
    raw = {d: [json.loads(x) for x in open(f"{DATA}/{d}.jsonl", encoding="utf-8")] for d in DATASETS}
    for d in DATASETS:
        folder = root / "m" / d
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{label}.jsonl", "w", encoding="utf-8") as fh:
            for rec, r in zip(load(d, DATA), raw[d]):
                solution = r.get("solution") or r["answer"] if d != "aime25" else rf"\boxed{{{r['answer']}}}"
                text = solution if right else r"\boxed{123456}"
                fh.write(json.dumps({"id": rec["id"], "answers": [rec["answer"]], "pred": text}) + "\n")


def test_the_reference_solutions_grade_right_and_a_wrong_number_wrong(tmp_path):
    _predictions(tmp_path, "right", True)
    _predictions(tmp_path, "wrong", False)
    table = evaluate(str(tmp_path))
    assert table[0] == ["label"] + DATASETS + ["avg"]
    rows = {row[0]: row[1:] for row in table[1:]}
    assert rows["m/right"] == [100.0] * 5 and rows["m/wrong"] == [0.0] * 5
    assert eval_math.main(["--results_dir", str(tmp_path)]) == table
    assert (tmp_path / "results_math.csv").exists()


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def _fails(capsys, argv, *what):
    with pytest.raises(SystemExit) as exit_:
        run_math.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert all(w in err[0] for w in what), err[0]


def test_startup_errors_are_one_line_before_the_model(tmp_path, capsys, monkeypatch, no_model):
    save = ["--save_dir", str(tmp_path / "out")]
    _fails(capsys, ["--data_dir", DATA] + save, "--max_new_tokens: 32768 new tokens leave no room", "8192")
    _fails(capsys, ["--data_dir", DATA, "--max_new_tokens", "64", "--query_agnostic"] + save, "--query_agnostic")
    _fails(capsys, ["--data_dir", f"{DATA}/gsm8k.jsonl", "--max_new_tokens", "64"] + save, "--datasets")

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(models, "hub_unreachable", lambda: None)
    _fails(capsys, ["--data_dir", str(tmp_path), "--datasets", "aime25", "--max_new_tokens", "64"] + save,
           "--data_dir: aime25 not found", "(ConnectionError: no network)", "hf download math-ai/aime25")
    monkeypatch.setattr(models, "hub_unreachable", lambda: "HF_HUB_OFFLINE is set")  # cache only, no retries
    _fails(capsys, ["--datasets", "gsm8k", "--max_new_tokens", "64"] + save,
           "gsm8k not found", "the hub is unreachable (HF_HUB_OFFLINE is set)", "hf download openai/gsm8k")
    assert not (tmp_path / "out").exists()


def test_records_hold_each_problem_once_and_resume(tmp_path, monkeypatch):
    calls = []

    def fake(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
        calls.append((len(prompts), max_new_tokens))
        return [([r"\boxed{6}"] * len(prompts), None) for _ in configs]

    monkeypatch.setattr(loop, "decode_configs", fake)
    argv = ["--data_dir", DATA, "--datasets", "gsm8k", "--method", "fullkv", "--max_new_tokens", "16",
            "--batch_size", "2", "--save_dir", str(tmp_path)]
    files = run_math.main(argv)
    run_math.main(argv)
    assert calls == [(2, 16), (1, 16)]  # the second run finds every record written
    recs = read(files[("gsm8k", "fullkv")])
    assert [(r["id"], r["answers"], r["pred"]) for r in recs] == [
        ("gsm8k-0", ["6"], r"\boxed{6}"), ("gsm8k-1", ["90"], r"\boxed{6}"), ("gsm8k-2", ["2,500"], r"\boxed{6}")]
    assert evaluate(str(tmp_path))[1] == ["smollm2-135m/fullkv", 33.33, 33.33]


@pytest.mark.slow
def test_end_to_end_on_smollm2_with_eviction_while_decoding(tmp_path, monkeypatch):
    calls, real = [], loop.decode_configs

    def spy(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
        calls.append([c.get("decode_interval") for c in configs])
        return real(model, tokenizer, prompts, configs, max_new_tokens, sweep)

    monkeypatch.setattr(loop, "decode_configs", spy)
    argv = ["--data_dir", DATA, "--datasets", "aime25", "gsm8k", "--method", "snapkv", "fullkv",
            "--max_capacity_prompts", "48", "--window_size", "8", "--decode_interval", "4", "--max_new_tokens", "10",
            "--batch_size", "3", "--save_dir", str(tmp_path)]
    files = run_math.main(argv)
    assert calls == [[4, None]] * 2  # one prefill per batch for both configs; the decoding knob reaches snapkv
    assert sorted({label for _, label in files}) == ["fullkv", "snapkv_48-decode_interval=4-window_size=8"]
    recs = read(files[("gsm8k", "fullkv")])
    assert [r["id"] for r in recs] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert [r["answers"] for r in recs] == [["6"], ["90"], ["2,500"]]
    assert all(isinstance(r["pred"], str) and 40 < r["prompt_tokens"] < 200 for r in recs)
    meta = json.loads((tmp_path / "smollm2-135m" / "run_meta.json").read_text())
    assert meta["benchmark"] == "math" and meta["tasks"] == ["aime25", "gsm8k"]
    run_math.main(argv)  # resumes: nothing left to decode
    assert len(calls) == 2
    table = evaluate(str(tmp_path))
    assert [row[0] for row in table[1:]] == ["smollm2-135m/fullkv",
                                             "smollm2-135m/snapkv_48-decode_interval=4-window_size=8"]
