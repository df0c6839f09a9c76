"""SCBench's shared-context tasks: prompts and references as SCBench builds them, its scorers against
hand-checked cases, several questions on one compressed context against independent decodes, the runner on
fixture data (its hub schema) end to end."""

import json

import pytest
import torch
from transformers import AutoTokenizer

import eval_scbench
import run_scbench
from helpers import ROOT, prompt, tiny_model, tiny_tokenizer
from restkv.bench.generation import answer_questions
from restkv.bench.ruler.generate import load_tokenizer
from restkv.bench.scbench.evaluate import evaluate
from restkv.bench.scbench.metrics import SCORERS, score_turns
from restkv.bench.scbench.run import load, make_task
from restkv.bench.scbench.tasks import TASKS, references, turns
from restkv.data.prompts import build_prompt, context_and_questions, encode

DATA = str(ROOT / "tests" / "bench" / "fixtures" / "scbench")


def read(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_every_task_loads_and_builds_its_context_and_questions():
    for task in TASKS:
        records = load(task, DATA)
        context, questions = turns(task, records[0])
        assert len(questions) == len(records[0]["multi_turns"]) == len(references(task, records[0])), task
        assert "{" not in questions[0] or task == "scbench_kv", task
    kv = load("scbench_kv", DATA)[0]
    assert turns("scbench_kv", kv)[0].startswith(
        "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{")
    assert turns("scbench_kv", kv)[1][1] == 'Key: "e8b1-3c6d"\nThe value associated with the specified key is: '
    choice = load("scbench_choice_eng", DATA)[0]
    assert turns("scbench_choice_eng", choice)[1][0] == (
        "Question: Who kept the light lit after the storm?\nA. Mara Quell\nB. Ivo Brand\nC. A fisherman\nD. Nobody"
        "\n\nThe the correct answer is")
    assert references("scbench_choice_eng", choice) == [["Ivo Brand", "B"], ["1901", "C"]]
    assert references("scbench_qa_eng", load("scbench_qa_eng", DATA)[0]) == [["Mara Quell"], ["a storm"]]
    mf = load("scbench_mf", DATA)[0]  # the context template takes the first question; a list context as text
    assert turns("scbench_mf", mf) == (
        "The largest number of the list is: \n\n[12, 7, 93, 41, 5, 66]",
        ["What is the largest number of the list?\n\nThe largest number of the list is: ",
         "What is the smallest number of the list?\n\nThe smallest number of the list is: "])
    assert [r["id"] for r in load("scbench_vt", DATA)] == [0]  # no ids in the data: positions
    assert len(make_task("scbench_kv", load("scbench_kv", DATA), max_turns=1).records[0]["multi_turns"]) == 1


@pytest.mark.parametrize("task, prediction, reference, score", [
    ("scbench_kv", 'The value is "9b0e-1d44".', "9b0e-1d44", 1.0),
    ("scbench_kv", "9b0e-1d4", "9b0e-1d44", 0.0),
    ("scbench_prefix_suffix", "banana-1180-kappa", "banana-1180-kappa", 1.0),
    ("scbench_vt", "qpx, lmn", ["QPX", "LMN", "RTA"], 0.67),  # two of three, case ignored, 2 decimals
    ("scbench_qa_eng", "  mara quell built it", ["Mara Quell"], 1.0),
    ("scbench_qa_eng", "Ivo", ["Mara Quell"], 0.0),
    ("scbench_many_shot", " (A)", "(A)", 1.0),
    ("scbench_many_shot", "(B)", "(A)", 0.0),  # SCBench's loop over the string's characters would give 1
    ("scbench_choice_eng", "B", ["Ivo Brand", "B"], 1.0),
    ("scbench_choice_eng", " Ivo Brand", ["Ivo Brand", "B"], 1.0),  # the option text itself
    ("scbench_choice_eng", "The answer is B", ["Ivo Brand", "B"], 1.0),  # after "answer is"
    ("scbench_choice_eng", "C", ["Ivo Brand", "B"], 0.0),
    ("scbench_choice_eng", "", ["Ivo Brand", "B"], 0.0),
    ("scbench_mf", "93", 93, 1.0),
    ("scbench_mf", "93.0 is the largest", 93, 1.0),
    ("scbench_mf", "The largest is 66", 93, 0.0),
    ("scbench_mf", "none", 93, 0.0),
    ("scbench_qa_chn", "玛拉", "玛拉", 1.0),
    ("scbench_qa_chn", "玛拉建造", "玛拉", 2 / 3),  # 2 shared characters: precision 1/2, recall 1
    ("scbench_summary", "a lighthouse kept lit", "a lighthouse kept lit", 1.0),
    ("scbench_summary", "zebra", "a lighthouse kept lit", 0.0),
])
def test_scorers_on_hand_checked_cases(task, prediction, reference, score):
    assert SCORERS[task](prediction, reference) == pytest.approx(score)


def test_a_context_scores_the_mean_of_its_questions():
    assert score_turns("scbench_kv", ["9b0e-1d44", "x"], ["9b0e-1d44", "7a2c-90fe"]) == 0.5
    with pytest.raises(ValueError, match="1 answers for 2 questions"):
        score_turns("scbench_kv", ["x"], ["a", "b"])


def test_the_context_is_the_same_for_every_question_and_fits():
    tokenizer = load_tokenizer("smollm2-135m")
    context, questions = "The pass key is 71432. " * 40, ["What is the pass key?", "Say it again."]
    ids, asked = context_and_questions(tokenizer, context, questions, 4096, "on")
    for q, a in zip(questions, asked):  # the whole prompt of each question, as one user turn
        assert tokenizer.decode(ids + a) == build_prompt(tokenizer, context + q, "on")
    assert ids == encode(tokenizer, build_prompt(tokenizer, context + "\u2063", "on").split("\u2063")[0])
    ids, asked = context_and_questions(tokenizer, context, questions, 4096, "off")
    assert ids == encode(tokenizer, context) and asked[0] == tokenizer(questions[0], add_special_tokens=False).input_ids
    ids, asked = context_and_questions(tokenizer, context, questions, 120, "on", reserve=10)
    assert len(ids) + max(map(len, asked)) + 10 <= 122  # middle-truncated to fit (a token of slack at the cut)
    with pytest.raises(ValueError, match="leaves no room"):
        context_and_questions(tokenizer, context, questions, 30, "on", reserve=10)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return tiny_model(), AutoTokenizer.from_pretrained(tiny_tokenizer())


def test_several_questions_on_one_compressed_context_equal_independent_decodes(tiny):
    model, tokenizer = tiny
    ctx = [prompt(50, seed=s)[0].tolist() for s in (1, 2)]
    qs = [[prompt(5, seed=3)[0].tolist(), prompt(7, seed=4)[0].tolist()],
          [prompt(5, seed=5)[0].tolist(), prompt(7, seed=6)[0].tolist()]]
    full, snap = dict(method="fullkv"), dict(method="snapkv", max_capacity_prompt=20, window_size=4)
    swept = answer_questions(model, tokenizer, ctx, qs, [full, snap], 8)
    # the full cache: greedy generate on context + question, no compression anywhere
    import restkv

    restkv.detach(model)
    for r in range(2):
        for j in range(2):
            ids = torch.tensor([ctx[r] + qs[r][j]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
            assert swept[0][0][r][j] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # each question alone, each row alone, one config at a time: the same answers
    for r in range(2):
        for j in range(2):
            alone = answer_questions(model, tokenizer, [ctx[r]], [[qs[r][j]]], [snap], 8, sweep=False)
            assert alone[0][0][0][0] == swept[1][0][r][j]
    assert swept[1][0][0] != swept[0][0][0] or swept[1][0][1] != swept[0][0][1]  # the budget changed something
    kept = swept[1][1]
    assert all(k.shape[:2] == (2, 2) and k.shape[2] == 20 for k in kept)


def test_interrupt_and_resume_keep_each_context_once(tmp_path, monkeypatch):
    from restkv.bench import datasets as runs

    state = {"calls": [], "fail_on": 2}

    class Interrupted(Exception):
        pass

    def fake(model, tokenizer, prompts, configs, max_new_tokens, sweep=True, question_starts=None):
        state["calls"].append(([len(p[1]) for p in prompts], question_starts))
        if len(state["calls"]) == state["fail_on"]:
            raise Interrupted
        return [([[f"a{j}" for j in range(len(p[1]))] for p in prompts], None) for _ in configs]

    monkeypatch.setattr(runs, "decode_turns", fake)
    argv = ["--data_dir", DATA, "--tasks", "scbench_kv", "--method", "fullkv", "--max_new_tokens", "2",
            "--save_dir", str(tmp_path)]
    with pytest.raises(Interrupted):
        run_scbench.main(argv)
    path = tmp_path / "smollm2-135m" / "scbench_kv" / "fullkv.jsonl"
    assert [r["id"] for r in read(path)] == [0]
    state.update(calls=[], fail_on=None)
    run_scbench.main(argv)
    assert len(state["calls"]) == 1 and state["calls"][0][0] == [2]  # the second context, both its questions
    assert state["calls"][0][1] == [read(path)[0]["prompt_tokens"]]  # the context's length: where questions start
    assert [(r["id"], r["pred"]) for r in read(path)] == [(0, ["a0", "a1"]), (1, ["a0", "a1"])]
    run_scbench.main(argv)
    assert len(state["calls"]) == 1


@pytest.mark.slow
def test_end_to_end_on_smollm2(tmp_path, smollm2):
    argv = ["--data_dir", DATA, "--tasks", "scbench_kv", "scbench_mf", "--method", "snapkv", "fullkv",
            "--max_capacity_prompts", "48", "--window_size", "8", "--max_new_tokens", "6", "--batch_size", "2",
            "--save_dir", str(tmp_path)]
    files = run_scbench.main(argv)
    assert sorted({label for _, label in files}) == ["fullkv", "snapkv_48-window_size=8"]
    recs = read(files[("scbench_kv", "snapkv_48-window_size=8")])
    assert [r["id"] for r in recs] == [0, 1] and [r["answers"] for r in recs][0] == ["9b0e-1d44", "7a2c-90fe"]
    assert all(len(r["pred"]) == r["turns"] == 2 == len(r["question_tokens"]) for r in recs)
    assert all(r["query_agnostic"] and r["question_start"] == r["prompt_tokens"] > 48 for r in recs)
    meta = json.loads((tmp_path / "smollm2-135m" / "run_meta.json").read_text())
    assert meta["benchmark"] == "scbench" and meta["query_agnostic"] is True
    # the full cache's answers: greedy generate on context + question (no compression)
    model, tokenizer = smollm2
    record = load("scbench_kv", DATA)[1]
    ids, asked = context_and_questions(tokenizer, *turns("scbench_kv", record), 8192, "auto", 6)
    for j, question in enumerate(asked):
        full = torch.tensor([ids + question])
        out = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=6, do_sample=False)
        want = tokenizer.decode(out[0, full.shape[1]:], skip_special_tokens=True)
        assert read(files[("scbench_kv", "fullkv")])[1]["pred"][j] == want
    table = evaluate(str(tmp_path))
    assert [row[0] for row in table[1:]] == ["smollm2-135m/fullkv", "smollm2-135m/snapkv_48-window_size=8"]
    assert eval_scbench.main(["--results_dir", str(tmp_path)]) == table
    with pytest.raises(SystemExit):  # a rerun with other questions per context: refused
        run_scbench.main(argv + ["--max_turns", "1"])


@pytest.mark.parametrize("task, change, named", [
    ("scbench_kv", lambda turn: turn.pop("answer"), "record 2, turn 1 lacks fields ['answer']"),
    ("scbench_kv", lambda turn: turn.pop("input"), "record 2, turn 1 lacks fields ['input']"),
    ("scbench_choice_eng", lambda turn: turn.update(answer="nobody"), "its answer is none of its options"),
    ("scbench_mf", lambda turn: turn.update(input="no sentence here"), "its questions cannot be built"),
])
def test_a_record_missing_a_field_is_refused_in_one_line_before_the_model_loads(
        tmp_path, monkeypatch, capsys, task, change, named):
    from restkv.bench import loop

    records = read(f"{DATA}/{task}.jsonl")
    records = (records * 2)[:2]
    change(records[1]["multi_turns"][0])
    (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(loop, "load_from_args", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit_:
        run_scbench.main(["--data_dir", str(tmp_path), "--tasks", task, "--method", "fullkv",
                          "--save_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after datasets' own progress lines
    assert exit_.value.code == 2 and "Traceback" not in err and named in last and task in last, err
    assert not (tmp_path / "out").exists()


def test_a_rerun_with_other_settings_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from restkv.bench import datasets as runs
    from restkv.bench import models

    def fake(model, tokenizer, prompts, configs, max_new_tokens, sweep=True, question_starts=None):
        return [([["a"] * len(p[1]) for p in prompts], None) for _ in configs]

    monkeypatch.setattr(runs, "decode_turns", fake)
    argv = ["--data_dir", DATA, "--tasks", "scbench_kv", "--method", "fullkv", "--max_new_tokens", "2",
            "--save_dir", str(tmp_path)]
    run_scbench.main(argv)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    for other, what in ((["--max_new_tokens", "3"], "max_new_tokens=2 then, 3 now"),
                        (["--max_turns", "1"], "max_turns=None then, 1 now")):
        with pytest.raises(SystemExit) as exit_:
            run_scbench.main(argv + other)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and what in err[0] and "run_meta.json" in err[0], err


def test_the_run_ends_saying_where_its_results_are_and_how_to_score_them(tmp_path, monkeypatch, capsys):
    from restkv.bench import datasets as runs

    def fake(model, tokenizer, prompts, configs, max_new_tokens, sweep=True, question_starts=None):
        return [([["a"] * len(p[1]) for p in prompts], None) for _ in configs]

    monkeypatch.setattr(runs, "decode_turns", fake)
    save = tmp_path / "res"
    run_scbench.main(["--data_dir", DATA, "--tasks", "scbench_kv", "--method", "fullkv", "--max_new_tokens", "2",
                      "--save_dir", str(save)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2:] == [f"results: {save / 'smollm2-135m'}",
                        f"score them with: python eval_scbench.py --results_dir {save}"]
    assert eval_scbench.main(["--results_dir", str(save)])[1][0] == "smollm2-135m/fullkv"
