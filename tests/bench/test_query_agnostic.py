"""``--query_agnostic``: where each benchmark's question starts, the runs (sweep and one config at a time),
the mode in the metadata and the records, and resumed runs that refuse to mix the two modes."""

import json

import pytest

import run_infinite_bench
import run_longbench
import run_needle_in_haystack as needle_cli
import run_ruler
from restkv.bench.infinitebench.run import make_task as infinite_task
from restkv.bench.longbench.run import make_task as longbench_task
from restkv.bench.longbench.tasks import DATASETS, PROMPTS
from restkv.data.needles import NEEDLES, Haystack, make_case
from restkv.data.prompts import prompt_ids
from restkv.bench.ruler.generate import generate, load_tokenizer, write_task
from restkv.bench.ruler.run import prompt_ids as ruler_prompt_ids
from restkv.bench.ruler.tasks import TASKS
from restkv.bench.models import essays_dir
from helpers import fixture_record, passkey_record, write_fixture, write_passkey


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def read(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def question_of(tokenizer, ids, start):
    return tokenizer.decode(ids[start:])


def test_needle_question_starts_after_the_document(tokenizer):
    case = make_case(tokenizer, Haystack(tokenizer, essays_dir()), NEEDLES["passkey"], 700, 20, "auto", 650)
    assert case.truncated and case.needle_span[1] <= case.question_start < len(case.ids)
    assert question_of(tokenizer, case.ids, case.question_start).lstrip("\n").startswith("</document>\n\nQuestion:")
    assert "</document>" not in tokenizer.decode(case.ids[: case.question_start])


@pytest.mark.parametrize("dataset", DATASETS)
def test_longbench_question_is_the_template_after_the_context(tokenizer, dataset):
    task = longbench_task(dataset, [fixture_record(dataset, 0, words=60)])  # truncated to 400 tokens
    record = task.records[0]
    for chat in (False, True):
        text = task.text(record, chat)
        ids, start = prompt_ids(tokenizer, text, 400, "on" if chat else "off", 8, task.question(record, chat))
        after = PROMPTS[dataset].split("{context}", 1)[1].format(**record)
        assert ids == prompt_ids(tokenizer, text, 400, "on" if chat else "off", 8)
        tail = question_of(tokenizer, ids, start)
        assert 1 <= start < len(ids)
        assert after.strip()[:12] in tail or not after.strip()  # the question's text, not the context's
        assert record["context"][-20:] not in tail


def test_infinitebench_and_ruler_questions(tokenizer):
    task = infinite_task("passkey", [passkey_record(0)], "base")
    record = task.records[0]
    ids, start = prompt_ids(tokenizer, task.text(record, False), 400, "off", 8, task.question(record, False))
    assert question_of(tokenizer, ids, start).strip().startswith("What is the pass key?")
    summary = infinite_task("longbook_sum_eng", [record], "chat")
    ids, start = prompt_ids(tokenizer, summary.text(record, True), 400, "off", 8, summary.question(record, True))
    assert start == len(ids) - 1  # nothing after the book: only the last token follows the compression
    for name in ("niah_single_1", "vt", "cwe", "fwe"):
        rec = generate(name, tokenizer, 1024, 1)[0]
        ids, _, start = ruler_prompt_ids(tokenizer, rec, "auto", 2000, name)
        assert question_of(tokenizer, ids, start).lstrip().startswith(("What is the special", "Question:")), name
    with pytest.raises(ValueError, match="question template"):
        ruler_prompt_ids(tokenizer, {"index": 3, "input": "no question here", "answer_prefix": ""}, "off", 99, "vt")
    assert set(TASKS) >= {"niah_single_1", "vt"}


NEEDLE = ["--method", "snapkv", "fullkv", "--max_capacity_prompts", "96", "--needles", "passkey",
          "--context_lengths", "600", "--depth_percents", "10", "70", "--batch_size", "2", "--max_new_tokens", "8",
          "--no_plots"]


@pytest.mark.slow
def test_needle_runs_sweep_equals_separate_and_the_mode_is_recorded(tmp_path):
    _, swept, _ = needle_cli.main(NEEDLE + ["--query_agnostic", "--save_dir", str(tmp_path / "sweep")])
    _, separate, _ = needle_cli.main(NEEDLE + ["--query_agnostic", "--no_sweep", "--save_dir", str(tmp_path / "one")])
    _, aware, _ = needle_cli.main(NEEDLE + ["--save_dir", str(tmp_path / "aware")])
    strip = lambda rs: sorted(({k: v for k, v in r.items() if k != "seconds"} for r in rs),  # noqa: E731
                              key=lambda r: (r["label"], r["depth"]))
    assert strip(swept) == strip(separate) and len(swept) == 4
    assert all(r["query_agnostic"] and 500 < r["question_start"] < r["prompt_tokens"] for r in swept)
    assert all("query_agnostic" not in r for r in aware)
    assert {r["config_id"] for r in swept}.isdisjoint(r["config_id"] for r in aware)
    assert any(r["needle_kept"] < 1 for r in swept)  # the context was evicted
    meta = json.loads((tmp_path / "sweep" / "smollm2-135m" / "run_meta.json").read_text())
    assert meta["query_agnostic"] is True and "after its context" in meta["question_start"]


@pytest.mark.slow
def test_resumed_runs_do_not_mix_the_two_modes(tmp_path):
    data = write_fixture(tmp_path / "data", ["hotpotqa"], n=2, words=25)
    argv = ["--data_dir", data, "--datasets", "hotpotqa", "--method", "snapkv", "--max_capacity_prompts", "64",
            "--max_new_tokens", "6", "--save_dir", str(tmp_path / "res"), "--query_agnostic"]
    paths = run_longbench.main(argv + ["--max_num_examples", "1"])
    path = paths[("hotpotqa", "snapkv_64")]
    run_longbench.main(argv)  # resumes: the second record only
    records = read(path)
    assert [r["_id"] for r in records] == ["hotpotqa-0", "hotpotqa-1"]
    assert all(r["query_agnostic"] and r["question_start"] < r["prompt_tokens"] for r in records)
    with pytest.raises(SystemExit, match="2"):  # refused before the model loads
        run_longbench.main(argv[:-1])
    assert read(path) == records
    aware = tmp_path / "aware"
    run_longbench.main(argv[:-1] + ["--save_dir", str(aware), "--max_num_examples", "1"])
    with pytest.raises(SystemExit, match="2"):
        run_longbench.main(argv[:-2] + [str(aware), "--query_agnostic"])


@pytest.mark.slow
def test_longbench_infinitebench_and_ruler_sweep_equal_separate_runs(tmp_path, tokenizer):
    runs = {
        "longbench": (run_longbench, ["--data_dir", write_fixture(tmp_path / "lb", ["hotpotqa", "trec"], n=2, words=25),
                                      "--datasets", "hotpotqa", "trec", "--max_new_tokens", "6"]),
        "infinite": (run_infinite_bench, ["--data_dir", write_passkey(tmp_path / "ib", n=2, words=30),
                                          "--tasks", "passkey"]),
    }
    ruler = tmp_path / "ruler" / "1024"
    write_task(generate("niah_single_1", tokenizer, 1024, 2), ruler / "niah_single_1" / "validation.jsonl")
    runs["ruler"] = (run_ruler, ["--data_dir", str(ruler), "--max_new_tokens", "8"])
    for name, (runner, argv) in runs.items():
        argv = argv + ["--method", "snapkv", "adakv", "--max_capacity_prompts", "64", "--batch_size", "2",
                       "--query_agnostic"]
        swept = runner.main(argv + ["--save_dir", str(tmp_path / name / "sweep")])
        separate = runner.main(argv + ["--no_sweep", "--save_dir", str(tmp_path / name / "one")])
        assert list(swept) == list(separate), name
        for key, path in swept.items():
            a, b = read(path), read(separate[key])
            assert a == b and len(a) == 2 and all(r["query_agnostic"] for r in a), (name, key)


def test_metadata_refuses_to_mix_the_two_modes(tmp_path):
    from restkv.bench import grid, meta

    configs = grid.configs_meta([("snapkv_64", {"method": "snapkv", "max_capacity_prompt": 64})])
    meta.write_metadata(str(tmp_path / "a"), {}, {"configs": configs, "query_agnostic": True})
    meta.write_metadata(str(tmp_path / "a"), {}, {"configs": configs, "query_agnostic": True})  # resumes
    with pytest.raises(ValueError, match="made with --query_agnostic"):
        meta.write_metadata(str(tmp_path / "a"), {}, {"configs": configs, "query_agnostic": False})
    meta.write_metadata(str(tmp_path / "b"), {}, {"configs": configs})  # a run from before the option
    with pytest.raises(ValueError, match="made without --query_agnostic"):
        meta.write_metadata(str(tmp_path / "b"), {}, {"configs": configs, "query_agnostic": True})


def test_the_loop_hands_question_starts_to_the_decoder_and_records_them(tmp_path, monkeypatch):
    from argparse import Namespace

    from restkv.bench import loop

    calls = []

    def decode(model, tokenizer, prompts, configs, max_new_tokens, sweep=True, question_starts=None):
        calls.append(question_starts)
        return [([f"{len(p)}" for p in prompts], None) for _ in configs]

    monkeypatch.setattr(loop, "load_from_args", lambda args, shard: (None, None, 100))
    monkeypatch.setattr(loop, "decode_configs", decode)
    args = Namespace(model_path="m", save_dir=str(tmp_path), batch_size=2, no_sweep=False, query_agnostic=True)
    store = loop.per_label(str(tmp_path / "out"), ["full"], "unit")
    task = loop.Task("demo", [{"unit": 3}, {"unit": 5}], lambda u: [0] * u["unit"],
                     lambda u, ids, out: {"unit": u["unit"], "text": out.text}, 4, store,
                     question_start=lambda ids: len(ids) - 2)
    predictor = loop.Predictor(args, [("full", {"method": "fullkv"})])
    predictor.predict([task])
    assert calls == [[1, 3]]
    settings = {"attn_implementation": "sdpa", "dtype": "float32", "prompt_evicted": False}  # in every record
    assert read(tmp_path / "out" / "full.jsonl") == [
        {"unit": 3, "text": "3", **settings, "query_agnostic": True, "question_start": 1},
        {"unit": 5, "text": "5", **settings, "query_agnostic": True, "question_start": 3}]
    task.question_start = None
    with pytest.raises(ValueError, match="does not say where its questions start"):
        predictor.predict([task])
