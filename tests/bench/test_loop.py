"""The shared prediction loop: store plans, record order, resume and batching (a stand-in decoder, no model),
and the check of every config against the loaded model (a tiny one)."""

import json
from argparse import Namespace

import pytest

from restkv.bench import loop

CONFIGS = [("full", {"method": "fullkv"}), ("snap", {"method": "snapkv", "max_capacity_prompt": 64})]


def test_store_plans_are_unit_major_in_label_order(tmp_path):
    shared = loop.Store({"a": "f", "b": "f", "c": "g"}, ("unit", "label"), lambda unit, label: (unit, label))
    assert shared.plan([1, 2]) == {"f": [(1, "a"), (1, "b"), (2, "a"), (2, "b")], "g": [(1, "c"), (2, "c")]}
    per = loop.per_label(str(tmp_path), ["x", "y"], "id")
    assert per.paths == {"x": str(tmp_path / "x.jsonl"), "y": str(tmp_path / "y.jsonl")}
    assert per.plan([{"id": 3}, {"id": 4}]) == {str(tmp_path / "x.jsonl"): [(3,), (4,)],
                                                str(tmp_path / "y.jsonl"): [(3,), (4,)]}


def test_one_file_for_every_config_resumes_with_the_missing_configs_only(tmp_path, monkeypatch, capsys):
    calls = []

    def decode(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
        calls.append((prompts, [c["method"] for c in configs], max_new_tokens))
        return [([f"{len(p)}:{c['method']}" for p in prompts], None) for c in configs]

    monkeypatch.setattr(loop, "load_from_args", lambda args, shard: (None, None, 100))
    monkeypatch.setattr(loop, "check_against_model", lambda model, configs: None)  # no model here
    monkeypatch.setattr(loop, "decode_configs", decode)
    args = Namespace(model_path="some/model", save_dir=str(tmp_path), batch_size=2, no_sweep=False)
    path = str(tmp_path / "model" / "results.jsonl")

    def task():
        store = loop.Store({label: path for label, _ in CONFIGS}, ("unit", "label"), lambda u, label: (u, label))
        return loop.Task("demo", [1, 2, 3], lambda u: [0] * u,
                         lambda u, ids, out: {"unit": u, "label": out.label, "text": out.text, "row": out.row},
                         5, store, announce=True)

    first = loop.Predictor(args, CONFIGS[:1])
    assert first.out_dir == str(tmp_path / "model") and first.quant == {"full": None}
    first.predict([task()])
    assert calls == [([[0], [0, 0]], ["fullkv"], 5), ([[0, 0, 0]], ["fullkv"], 5)]
    calls.clear()
    loop.Predictor(args, CONFIGS).predict([task()])
    assert [methods for _, methods, _ in calls] == [["snapkv"], ["snapkv"]]
    assert "demo: 3 records to run" in capsys.readouterr().err
    records = [json.loads(line) for line in open(path)]
    assert [(r["unit"], r["label"]) for r in records] == [(1, "full"), (2, "full"), (3, "full"),
                                                          (1, "snap"), (2, "snap"), (3, "snap")]
    assert [r["row"] for r in records] == [0, 1, 0, 0, 1, 0] and records[4]["text"] == "2:snapkv"


def test_a_config_the_model_cannot_hold_ends_the_run_naming_its_label():
    """LaCache's ladder (span 16) needs more evicted layers than the tiny model's 3: one line, before any prompt."""
    from helpers import tiny_model

    from restkv.bench.loop import check_against_model

    model = tiny_model()
    check_against_model(model, [("snapkv_64", dict(method="snapkv", max_capacity_prompt=64)), ("fullkv", dict(method="fullkv"))])
    with pytest.raises(SystemExit, match=r"^lacache_64: span \(16\) must be smaller than the model's evicted layers \(3\)"):
        check_against_model(model, [("lacache_64", dict(method="lacache", max_capacity_prompt=64))])
