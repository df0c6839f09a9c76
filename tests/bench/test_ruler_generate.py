"""RULER generator: token lengths, answer counts, determinism, sizing, QA inputs."""

import json
import re
from collections import Counter

import pytest

from restkv.bench.ruler import cwe, fwe
from restkv.bench.ruler.generate import generate, load_tokenizer, main, write_task
from restkv.bench.ruler.sizing import largest_fitting
from restkv.bench.ruler.tasks import FAMILIES, SYNTHETIC, TASKS

# One haystack unit (noise paragraph, distractor needle, essay words...) in SmolLM2 tokens:
# a sample may fall short of the requested length by less than that.
TOLERANCE = {"niah_single_1": 32, "niah_multikey_2": 48, "niah_multikey_3": 90, "vt": 40}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def samples(tokenizer):
    return {(task, n): generate(task, tokenizer, n, 2) for task in SYNTHETIC for n in (1024, 4096)}


def count(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_lengths_hit_the_requested_length(samples, tokenizer):
    for (task, n), records in samples.items():
        new = FAMILIES[TASKS[task][0]]["tokens_to_generate"]
        for r in records:
            assert r["length"] == count(tokenizer, r["input"] + r["answer_prefix"]) + new, task
            assert n - TOLERANCE.get(task, 24) <= r["length"] <= n, (task, n, r["length"])


def test_niah_values_appear_once_under_the_queried_keys(samples):
    for (task, n), records in samples.items():
        if not task.startswith("niah"):
            continue
        args = TASKS[task][1]
        for r in records:
            assert len(r["outputs"]) == args["num_v"] * args["num_q"], task
            for value in r["outputs"]:
                assert r["input"].count(value) == 1, (task, value)
            needles = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", r["input"])
            query = re.search(r" for (.+) mentioned", r["answer_prefix"]).group(1)
            asked = query.replace(", and ", ", ").split(", ")
            assert len(asked) == args["num_q"], task
            found = [v for key in asked for k, v in needles if k == key]
            assert found == r["outputs"] or sorted(found) == sorted(r["outputs"]), task
            assert len(found) == len(r["outputs"]), task
            single = args["num_v"] * args["num_q"] == 1
            assert r["input"].startswith("A special magic" if single else "Some special magic"), task
            assert r["answer_prefix"].endswith(" is" if single else " are"), task


def test_vt_chain_leads_from_value_to_every_answer(samples):
    for n in (1024, 4096):
        for r in samples[("vt", n)]:
            question = r["input"][r["input"].rindex("Memorize and track"):]
            value = re.search(r"assigned the value (\d+) in", question).group(1)
            assert question.count(value) == 2  # the chain start and the question
            assigned = dict(re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", question))
            holders = [v for v, src in assigned.items() if src == value]
            for var, src in assigned.items():
                if src.startswith("VAR ") and src[4:] in holders:
                    holders.append(var)
            assert holders == r["outputs"] and len(holders) == 5
            assert value in r["answer_prefix"] and "5 variables" in r["answer_prefix"]


def test_cwe_common_words_repeat_as_configured(samples):
    for n in (1024, 4096):
        (common, uncommon), _ = cwe.repeats(n, 30, 3)
        for r in samples[("cwe", n)]:
            question = r["input"][r["input"].rindex("Below is a numbered list"):]
            counts = Counter(re.findall(r"\d+\. ([a-z]+)", question))
            assert len(r["outputs"]) == 10
            assert all(counts[w] == common for w in r["outputs"])
            assert all(c == uncommon for w, c in counts.items() if w not in r["outputs"])


def test_fwe_answers_are_the_three_most_frequent_coded_words(samples):
    for n in (1024, 4096):
        for r in samples[("fwe", n)]:
            text = r["input"].split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
            counts = Counter(text)
            ranked = [c for _, c in counts.most_common()]
            total = largest_fitting(lambda s: fwe.counts(s, 2.0, fwe.vocab_size(n))[0] <= counts["..."], 1)
            assert ranked == [c for c in fwe.counts(total, 2.0, fwe.vocab_size(n)) if c > 0]
            top = [w for w, _ in counts.most_common(5)]
            assert top[0] == fwe.NOISE_WORD and top[1:4] == r["outputs"]
            assert counts[top[3]] > counts[top[4]]


def test_same_seed_same_file_other_seed_other_file(tokenizer, tmp_path):
    for task in ("niah_multikey_2", "vt", "cwe"):
        files = []
        for name, seed in (("a", 7), ("b", 7), ("c", 8)):
            write_task(generate(task, tokenizer, 1024, 3, seed=seed), tmp_path / name / "v.jsonl")
            files.append((tmp_path / name / "v.jsonl").read_bytes())
        assert files[0] == files[1] and files[0] != files[2], task


def test_largest_fitting_finds_the_boundary_from_any_guess():
    for guess in (1, 5, 999, 5000):
        assert largest_fitting(lambda n: n * 3 <= 2999, guess) == 999
    assert largest_fitting(lambda n: True, 3, maximum=40) == 40
    assert largest_fitting(lambda n: n <= 10, 50, minimum=4) == 10
    with pytest.raises(ValueError, match="smallest size"):
        largest_fitting(lambda n: n < 4, 10, minimum=4)


def test_too_short_length_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="vt: max_seq_length=600 is too small"):
        generate("vt", tokenizer, 600, 1)


def _squad(path, n=6):
    paragraphs = [{"context": f"Paragraph {i}. The river Quell{i} flows north past mill {i}.",
                   "qas": [{"question": f"Which river passes mill {i}?", "is_impossible": False,
                            "answers": [{"text": f"Quell{i}"}]}]} for i in range(n)]
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": paragraphs}]}))
    return path


def _hotpot(path, n=4):
    data = [{"question": f"Who built tower {i}?", "answer": f"Mason{i}",
             "context": [[f"Tower {i}", [f"Tower {i} was built by Mason{i}. ", "It is tall."]],
                         [f"Town {i}", [f"Town {i} is small."]]]} for i in range(n)]
    path.write_text(json.dumps(data))
    return path


def test_qa_samples_hold_their_gold_document(tokenizer, tmp_path):
    for task, path in (("qa_1", _squad(tmp_path / "squad.json")), ("qa_2", _hotpot(tmp_path / "hotpot.json"))):
        records = generate(task, tokenizer, 256, 3, qa_file=path)
        for r in records:
            assert any(a in r["input"] for a in r["outputs"]) and r["answer_prefix"] == " Answer:"
            assert r["length"] <= 256 and "Document 1:\n" in r["input"]


def test_qa_without_a_local_file_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--tasks", "qa_1", "--out_dir", str(tmp_path)])
    assert "qa_1 needs a local SQuAD JSON" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q"}]}]}]}))
    with pytest.raises(ValueError, match=r"data\[0\]\.paragraphs\[0\]\.qas\[0\]: missing field 'answers'"):
        generate("qa_1", None, 256, 1, qa_file=bad)


def test_unknown_task_and_too_long_length_are_rejected_before_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--tasks", "niah_single_9", "--out_dir", str(tmp_path)])
    assert "--tasks: unknown ['niah_single_9']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tasks", "vt", "--lengths", "4096", "65536", "--out_dir", str(tmp_path)])
    assert "--lengths: 65536 tokens exceed the context of smollm2-135m: 8192 tokens" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
