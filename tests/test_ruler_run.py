"""RULER end to end on SmolLM2 at ~1K tokens: generate, predict (fullkv and snapkv), resume, score."""

import json

import pytest

import run_ruler
from restkv.bench.ruler.evaluate import evaluate
from restkv.bench.ruler.generate import generate, load_tokenizer, write_task


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_run_resume_and_score(tokenizer, tmp_path):
    data = tmp_path / "data" / "1024"
    for task in ("niah_single_1", "vt"):
        write_task(generate(task, tokenizer, 1024, 2), data / task / "validation.jsonl")
    argv = ["--data_dir", str(data), "--method", "fullkv", "snapkv", "--max_capacity_prompts", "128",
            "--num_samples", "1", "--max_new_tokens", "8", "--save_dir", str(tmp_path / "res")]
    run_ruler.main(argv + ["--tasks", "niah_single_1"])
    out = tmp_path / "res" / "smollm2-135m" / "1024"
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*.jsonl")}
    assert sorted(before) == ["niah_single_1/fullkv.jsonl", "niah_single_1/snapkv_128.jsonl"]
    run_ruler.main(argv)  # resume: only the vt predictions are missing
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.jsonl"))
    assert files == sorted(before) + ["vt/fullkv.jsonl", "vt/snapkv_128.jsonl"]
    assert all((out / f).read_bytes() == b for f, b in before.items())
    for f in files:
        [record] = read(out / f)
        assert record["index"] == 0 and isinstance(record["pred"], str) and not record["truncated"]
        assert record["prompt_tokens"] > 850 and record["method"] == f.split("/")[1][:-6]
    niah = read(out / "niah_single_1/fullkv.jsonl")[0]
    assert niah["pred"].strip().startswith(niah["outputs"][0])
    header, rows = evaluate(tmp_path / "res")
    assert header[4:] == ["niah_single_1", "vt", "avg"]
    assert [(r[1], r[2], r[3]) for r in rows] == [(1024, "fullkv", 1), (1024, "snapkv_128", 1)]
    assert rows[0][4] == 100.0


def test_prompt_is_chat_wrapped_with_the_answer_prefix_last(tokenizer):
    record = {"index": 0, "input": "word " * 300, "answer_prefix": " Answer: it is"}
    ids, cut = run_ruler.prompt_ids(tokenizer, record, "auto", 10_000)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n Answer: it is")
    assert not cut
    short, cut = run_ruler.prompt_ids(tokenizer, record, "auto", len(ids) - 100)
    assert cut and len(ids) - 110 <= len(short) <= len(ids) - 100
    assert tokenizer.decode(short).endswith(" Answer: it is")


def test_ruler_own_folders_need_a_context_length(tmp_path):
    folder = tmp_path / "synthetic" / "4096" / "data" / "niah_single_2"
    folder.mkdir(parents=True)
    (folder / "validation.jsonl").write_text(
        json.dumps({"index": 0, "input": "text", "outputs": ["1234567"], "length": 4000}) + "\n")
    with pytest.raises(ValueError, match="validation.jsonl record 1: no 'max_seq_length'"):
        run_ruler.load_data([str(folder.parent)], None, None, None)
    [(task, records)] = run_ruler.load_data([str(folder.parent)], None, None, 4096)
    assert task == "niah_single_2" and records[0]["max_seq_length"] == 4096
    assert records[0]["answer_prefix"] == ""
    (folder / "validation.jsonl").write_text(json.dumps({"index": 0, "input": "t", "outputs": "x"}) + "\n")
    with pytest.raises(ValueError, match="record 1: 'outputs' must be a non-empty list"):
        run_ruler.load_data([str(folder.parent)], None, None, 4096)
