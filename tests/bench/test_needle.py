"""Needle-in-a-Haystack on the packaged SmolLM2 (prompts of ~1K tokens at most)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import run_needle_in_haystack as cli
from helpers import ROOT
from restkv.bench import models
from restkv.bench.models import essays_dir
from restkv.bench.needle import metrics
from restkv.data import needles as data
from restkv.bench.needle.run import KEY_FIELDS

METHODS = ("fullkv", "restkv", "snapkv", "h2o", "streamingllm", "pyramidkv", "cam", "l2norm")


def test_insert_needle_at_a_sentence_boundary():
    ctx = [1, 2, 0, 3, 4, 5, 0, 6, 7, 8]  # 0 ends a sentence

    def is_end(t):
        return t == 0

    assert data.insert_needle(ctx, [9, 9], 50, is_end) == ([1, 2, 0, 9, 9, 3, 4, 5, 0, 6, 7, 8], 3)
    assert data.insert_needle(ctx, [9], 0, is_end)[1] == 0
    assert data.insert_needle(ctx, [9], 75, is_end)[1] == 7
    assert data.insert_needle(ctx, [9], 100, is_end) == (ctx + [9], 10)


def test_scores():
    s = metrics.score("The pass key is 71432.", "The pass key is 71432.", "71432")
    assert s["score"] == 1.0 and s["exact"] == 1.0 and s["rouge1_f"] == pytest.approx(1.0)
    assert metrics.digit_score("It is 71,432!", "71432") == 1.0
    assert metrics.digit_score("key 71482", "71432") == pytest.approx(0.8)
    assert metrics.digit_score("7143", "71432") == pytest.approx(0.8)
    assert metrics.digit_score("14327", "71432") == 0.0
    assert metrics.score("no idea", "The pass key is 71432.", "71432")["score"] == 0.0
    sf = data.NEEDLES["sf"]
    good = metrics.score("Eat a sandwich and sit in Dolores Park on a sunny day.", sf.text, sf.answer)
    half = metrics.score("Sit in Dolores Park.", sf.text, sf.answer)
    assert good["exact"] == 1.0 and good["score"] == 1.0 and half["exact"] == 0.0 and 0 < half["score"] < 1
    assert good["rouge1_f"] > half["rouge1_f"] > 0


def test_make_case_places_the_needle(smollm2):
    _, tok = smollm2
    hay = data.Haystack(tok, essays_dir())
    sf = data.NEEDLES["sf"]
    spans = []
    for depth in (0, 50, 100):
        case = data.make_case(tok, hay, sf, 600, depth)
        assert abs(len(case.ids) - 600) <= 4 and not case.truncated
        start, end = case.needle_span
        assert tok.decode(case.ids[start:end]).strip() == sf.text
        if depth == 50:  # just after a sentence end
            assert tok.decode(case.ids[:start]).rstrip().endswith((".", "!", "?"))
        spans.append(start)
    assert spans[0] < 80 < spans[1] < spans[2] and spans[1] < 0.5 * 600
    cut = data.make_case(tok, hay, data.NEEDLES["passkey"], 600, 90, max_length=300)
    assert cut.truncated and len(cut.ids) == 300
    assert tok.decode(cut.ids[slice(*cut.needle_span)]).strip() == cut.needle_text
    assert data.make_case(tok, hay, sf, 600, 50, max_length=300).needle_span is None


def test_missing_haystack_and_unknown_model_fail_clearly(tmp_path, smollm2, capsys):
    for argv, what in ((["--haystack_dir", str(tmp_path / "nope")], "--haystack_dir: haystack folder .* does not exist"),
                       (["--model_path", "no-such-model"], "model_path: 'no-such-model'")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv + ["--save_dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and re.search(what, err) and len(err.strip().splitlines()) == 1
    with pytest.raises(FileNotFoundError, match="no .txt"):
        data.Haystack(smollm2[1], tmp_path)


@pytest.fixture(scope="module")
def fullkv_1k(tmp_path_factory):
    """fullkv on one 1K-token pass-key prompt, through the command line entry point."""
    return cli.main(["--method", "fullkv", "--needles", "passkey", "--context_lengths", "1024",
                     "--depth_percents", "40", "--max_new_tokens", "10",
                     "--save_dir", str(tmp_path_factory.mktemp("needle"))])


def test_fullkv_finds_a_numeric_needle(fullkv_1k):
    path, records, pngs = fullkv_1k
    assert len(records) == 1 and records[0]["method"] == "fullkv"
    r = records[0]
    assert r["exact"] == 1.0 and r["score"] == 1.0 and r["answer"] in r["response"]
    assert 1000 <= r["prompt_tokens"] <= 1024 and r["needle_kept"] == 1.0
    assert all(os.path.isfile(p) for p in pngs) and any(p.endswith("scores.png") for p in pngs)  # no budget: bars
    assert not any("budget_curve" in p for p in pngs)
    meta = json.load(open(os.path.join(os.path.dirname(path), "run_meta.json")))
    assert meta["benchmark"] == "needle" and meta["versions"]["transformers"]


def test_budget_over_length_equals_fullkv(tmp_path):
    _, records, _ = cli.main(["--method", ",".join(METHODS), "--max_capacity_prompts", "600", "--needles",
                              "passkey", "--context_lengths", "512", "--depth_percents", "60",
                              "--max_new_tokens", "10", "--no_plots", "--save_dir", str(tmp_path)])
    assert sorted(r["method"] for r in records) == sorted(METHODS)
    full = next(r for r in records if r["method"] == "fullkv")
    assert full["answer"] in full["response"]
    for r in records:
        assert r["response"] == full["response"], r["label"]
        assert r["needle_kept"] == 1.0, r["label"]


@pytest.mark.slow
def test_killed_run_resumes_without_loss_or_duplicates(tmp_path):
    argv = [sys.executable, "run_needle_in_haystack.py", "--method", "fullkv", "streamingllm",
            "--max_capacity_prompts", "64", "--needles", "passkey", "--context_lengths", "300",
            "--depth_percents", "0:100:50", "--max_new_tokens", "4", "--no_plots", "--save_dir", str(tmp_path)]
    path = tmp_path / "smollm2-135m" / "results.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = path.read_text().splitlines()
    assert 2 <= len(before) < 6
    with open(path, "a") as fh:
        fh.write(before[-1][: len(before[-1]) // 2])  # a write cut short
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    after = path.read_text().splitlines()
    assert after[: len(before)] == before
    keys = [tuple(json.loads(line)[k] for k in KEY_FIELDS) for line in after]
    assert len(keys) == len(set(keys)) == 6
    assert {(k[1], k[4]) for k in keys} == {(m, d) for m in ("fullkv", "streamingllm_64") for d in (0, 50, 100)}
    assert "fullkv" in done.stdout and "streamingllm_64" in done.stdout


def test_bad_knob_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--alpha", "1.5", "--save_dir", str(tmp_path)])
    assert exit_.value.code == 2 and "restkv_128: alpha" in capsys.readouterr().err


def test_quantized_records_and_metadata(tmp_path):
    path, records, _ = cli.main(["--method", "snapkv", "--max_capacity_prompts", "64", "--quant_method", "hqq",
                                 "--nbits", "4", "--needles", "passkey", "--context_lengths", "300",
                                 "--depth_percents", "50", "--max_new_tokens", "4", "--no_plots",
                                 "--save_dir", str(tmp_path)])
    quant = {"quant_method": "hqq", "nbits": 4, "residual_length": 32, "q_group_size": 64}
    (r,) = records
    assert r["label"] == "snapkv_64-quant_method=hqq" and r["quant"] == quant
    meta = json.load(open(os.path.join(os.path.dirname(path), "run_meta.json")))
    assert meta["configs"]["snapkv_64-quant_method=hqq"]["quant"] == quant
    assert meta["config"]["quant_method"] == "hqq"


def test_a_rerun_with_other_settings_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    argv = ["--method", "fullkv", "--needles", "passkey", "--context_lengths", "300", "--depth_percents", "50",
            "--max_new_tokens", "4", "--no_plots", "--save_dir", str(tmp_path)]
    path, records, _ = cli.main(argv)
    before = open(path).read()
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    for other, what in ((["--max_new_tokens", "8"], "max_new_tokens=4 then, 8 now"),
                        (["--seed", "1"], "seed=42 then, 1 now")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv + other)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and what in err[0] and "run_meta.json" in err[0], err
    assert open(path).read() == before


def test_results_whose_run_meta_was_moved_away_are_not_added_to(tmp_path, monkeypatch, capsys):
    argv = ["--method", "fullkv", "--needles", "passkey", "--context_lengths", "300", "--depth_percents", "50",
            "--max_new_tokens", "4", "--no_plots", "--save_dir", str(tmp_path)]
    path, _, _ = cli.main(argv)
    before = open(path).read()
    meta = tmp_path / "smollm2-135m" / "run_meta.json"
    meta.write_text("{")  # corrupted: refused, and moving it away loses what the results were made with
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    for then, what in ((lambda: None, f"{meta}: not JSON"),
                       (lambda: meta.rename(tmp_path / "moved.json"), f"{meta.parent} holds results (results.jsonl) "
                                                                       "but no run_meta.json")):
        then()
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv + ["--max_new_tokens", "8"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and what in err[0] and "another --save_dir" in err[0], err
    assert open(path).read() == before


def test_an_empty_haystack_or_a_length_too_short_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "empty").mkdir()
    for argv, what in ((["--haystack_dir", str(tmp_path / "empty")], r"--haystack_dir: .* holds no \.txt file"),
                       (["--context_lengths", "64"], "--context_lengths: context length 64 leaves no room")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv + ["--save_dir", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and re.search(what, err[0]), err
    assert not (tmp_path / "out").exists()
