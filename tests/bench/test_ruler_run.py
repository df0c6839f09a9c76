"""RULER end to end on SmolLM2 at ~1K tokens: generate, predict, resume, score; sweep and sharded runs."""

import json
import os
import shlex

import pytest

import run_ruler
from helpers import ROOT
from restkv.bench import grid, loop, shard
from restkv.bench.ruler.evaluate import evaluate
from restkv.bench.ruler.generate import generate, load_tokenizer, write_task
from restkv.bench.ruler.run import load_data, prompt_ids
from restkv.bench.ruler.tasks import SYNTHETIC


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def data(tokenizer, tmp_path_factory):
    """Three ~1K-token samples of niah_single_1 and vt."""
    folder = tmp_path_factory.mktemp("ruler") / "1024"
    for task in ("niah_single_1", "vt"):
        write_task(generate(task, tokenizer, 1024, 3), folder / task / "validation.jsonl")
    return str(folder)


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
    ids, cut = prompt_ids(tokenizer, record, "auto", 10_000)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n Answer: it is")
    assert not cut
    short, cut = prompt_ids(tokenizer, record, "auto", len(ids) - 100)
    assert cut and len(ids) - 110 <= len(short) <= len(ids) - 100
    assert tokenizer.decode(short).endswith(" Answer: it is")


def test_ruler_own_folders_need_a_context_length(tmp_path):
    folder = tmp_path / "synthetic" / "4096" / "data" / "niah_single_2"
    folder.mkdir(parents=True)
    (folder / "validation.jsonl").write_text(
        json.dumps({"index": 0, "input": "text", "outputs": ["1234567"], "length": 4000}) + "\n")
    with pytest.raises(ValueError, match="validation.jsonl record 1: no 'max_seq_length'"):
        load_data([str(folder.parent)], None, None, None)
    [(task, records)] = load_data([str(folder.parent)], None, None, 4096)
    assert task == "niah_single_2" and records[0]["max_seq_length"] == 4096
    assert records[0]["answer_prefix"] == ""
    with pytest.raises(ValueError, match="niah_single_2 at length 4096 is also in"):
        load_data([str(folder.parent)] * 2, None, None, 4096)
    (folder / "validation.jsonl").write_text(json.dumps({"index": 0, "input": "t", "outputs": "x"}) + "\n")
    with pytest.raises(ValueError, match="record 1: 'outputs' must be a non-empty list"):
        load_data([str(folder.parent)], None, None, 4096)


@pytest.mark.slow
def test_sweep_equals_one_config_at_a_time(data, tmp_path):
    argv = ["--data_dir", data, "--method", "restkv", "snapkv", "fullkv", "--max_capacity_prompts", "128",
            "--num_samples", "1", "--max_new_tokens", "8"]
    swept = run_ruler.main(argv + ["--save_dir", str(tmp_path / "sweep")])
    separate = run_ruler.main(argv + ["--no_sweep", "--save_dir", str(tmp_path / "separate")])
    assert list(swept) == list(separate) and len(swept) == 2 * 3
    for key, path in swept.items():
        a, b = read(tmp_path / path), read(tmp_path / separate[key])
        assert a == b and len(a) == 1 and a[0]["prompt_tokens"] > 850 and not a[0]["truncated"], key


def fake_decode(calls):
    """A ``decode_configs`` stand-in that logs ``(prompt lengths, methods)`` and answers ``<length>:<method>``."""
    def decode(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
        calls.append(([len(p) for p in prompts], [c["method"] for c in configs]))
        return [([f"{len(p)}:{c['method']}" for p in prompts], None) for c in configs]
    return decode


def test_resume_decodes_only_the_missing_configs(data, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(loop, "decode_configs", fake_decode(calls))
    argv = ["--data_dir", data, "--tasks", "vt", "--max_capacity_prompts", "64", "--save_dir", str(tmp_path)]
    first = run_ruler.main(argv + ["--method", "fullkv", "--num_samples", "1"])
    before = open(first[(1024, "vt", "fullkv")]).read()
    calls.clear()
    files = run_ruler.main(argv + ["--method", "streamingllm", "fullkv"])
    assert [methods for _, methods in calls] == [["streamingllm"], ["streamingllm", "fullkv"],
                                                 ["streamingllm", "fullkv"]]
    assert open(files[(1024, "vt", "fullkv")]).read().startswith(before)
    for path in files.values():
        assert [r["index"] for r in read(tmp_path / path)] == [0, 1, 2]


def test_two_shards_merge_into_the_single_process_file(data, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "decode_configs", fake_decode([]))
    monkeypatch.setattr(shard.Shard, "barrier", lambda self: None)
    argv = ["--data_dir", data, "--method", "streamingllm", "fullkv", "--max_capacity_prompts", "64"]
    single = run_ruler.main(argv + ["--save_dir", str(tmp_path / "one")])
    for rank in (1, 0):  # the main process finishes last and merges
        monkeypatch.setattr(loop, "current", lambda rank=rank: shard.Shard(rank, 2))
        sharded = run_ruler.main(argv + ["--save_dir", str(tmp_path / "two")])
    assert list(sharded) == list(single) and len(single) == 2 * 2
    for key, path in single.items():
        assert open(sharded[key]).read() == open(path).read() and len(read(tmp_path / path)) == 3, key
        assert sorted(os.listdir(os.path.dirname(sharded[key]))) == ["fullkv.jsonl", "streamingllm_64.jsonl"]
    meta = json.load(open(tmp_path / "two" / "smollm2-135m" / "run_meta.json"))
    assert meta["processes"] == 2 and meta["labels"] == ["streamingllm_64", "fullkv"]


def test_the_docs_example_states_the_records_it_plans_and_a_small_sample_flag():
    """docs/benchmarks.md's RULER commands: the records the run plans, counted from their flags, and a flag
    that runs a few samples of each task."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    block = text.split("## RULER", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    gen, run = [shlex.split(line.split("#")[0]) for line in block.splitlines() if "generate" in line or "run_ruler" in line]
    assert gen[gen.index("--tasks") + 1] == "synthetic"
    samples = int(gen[gen.index("--num_samples") + 1])
    configs = len(grid.method_configs(run_ruler.parse_args(run[2:])))
    flat = " ".join(text.split())
    tasks = len(SYNTHETIC)
    assert f"{tasks} tasks x {samples} samples x {configs} configs = {tasks * samples * configs:,} records" in flat
    assert run_ruler.parse_args(run[2:] + ["--num_samples", "1"]).num_samples == 1
    assert f"`--num_samples 1` on `run_ruler.py` runs the first sample of each task: {tasks * configs} records" in flat
