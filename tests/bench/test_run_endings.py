"""How every runner's run ends: a budget at least the prompt's length evicts nothing, and its records say
so (``prompt_evicted``) and the run ends with one line counting those prompts per config (``keeps_prompt``
against what the core keeps); Ctrl-C ends it with one line and exit code 130, and the same command resumes."""

import gc
import json

import pytest
import torch
from helpers import prompt, tiny_model, write_fixture, write_passkey

import run_infinite_bench
import run_longbench
import run_needle_in_haystack
import run_ruler
from restkv import CompressionConfig, configure, detach, kept_positions
from restkv.bench import loop
from restkv.strategies.budgets import keeps_prompt


@pytest.mark.parametrize("knobs", [dict(method="snapkv"), dict(method="pyramidkv"),
                                   dict(method="adakv"), dict(method="streamingllm"),
                                   dict(method="restkv", layer_budget="global")])
def test_keeps_prompt_says_what_the_core_keeps(knobs):
    model = tiny_model()
    length = 80
    ids = prompt(length)
    for budget in (length - 1, length, length + 20):
        cfg = CompressionConfig(**knobs, max_capacity_prompt=budget)
        configure(model, **knobs, max_capacity_prompt=budget)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       pad_token_id=0)
        kept = [k for k in kept_positions(model) if k is not None]
        whole = all(k.shape[-1] >= length and sorted(set(k[0, 0].tolist())) == list(range(length))
                    for k in kept)
        assert keeps_prompt(cfg, length) == whole == (budget >= length), (knobs, budget)
        detach(model)
    ratio = CompressionConfig(method="snapkv", max_capacity_prompt_ratio=1.0)
    assert keeps_prompt(ratio, 500) and not keeps_prompt(CompressionConfig(method="snapkv",
                                                                           max_capacity_prompt_ratio=0.5), 500)
    assert keeps_prompt(CompressionConfig(method="fullkv"), 10**6)
    dms = CompressionConfig(method="dms", max_capacity_prompt=4096)
    assert not keeps_prompt(dms, 300)  # a threshold evicts below any budget
    assert keeps_prompt(dms, 100)  # except within the observation window (128), which is kept whole


def _stand_in(monkeypatch):
    monkeypatch.setattr(loop, "decode_configs", lambda model, tok, prompts, configs, n, sweep=True:
                        [(["42"] * len(prompts), None) for _ in configs])


def _records(folder):
    """``{label: records}`` of a results folder (a file per label, or the needle's one file)."""
    by_label = {}
    for path in sorted(folder.rglob("*.jsonl")):
        for line in path.open():
            record = json.loads(line)
            by_label.setdefault(record.get("label", path.stem), []).append(record)
    return by_label


def _ruler_data(folder):
    task = folder / "1024" / "niah_single_1"
    task.mkdir(parents=True)
    text = "The grass is green. The sky is blue. " * 40 + "What is the special magic number?"
    task.joinpath("validation.jsonl").write_text("".join(json.dumps(
        {"index": i, "input": text, "outputs": ["42"], "length": 1024, "max_seq_length": 1024}) + "\n" for i in range(2)))
    return [str(task.parent)]


RUNS = {  # runner, its data flags (made under a folder), how many prompts
    "needle": (run_needle_in_haystack.main, lambda d: ["--context_lengths", "300", "--depth_percents", "50",
                                                       "--needles", "passkey", "sf", "--no_plots"], 2),
    "ruler": (run_ruler.main, lambda d: ["--data_dir", *_ruler_data(d)], 2),
    "longbench": (run_longbench.main, lambda d: ["--data_dir", write_fixture(d, ["qasper"], n=2, words=20),
                                                 "--datasets", "qasper"], 2),
    "infinite_bench": (run_infinite_bench.main, lambda d: ["--data_dir", write_passkey(d, n=3), "--tasks",
                                                           "passkey"], 3),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_every_runner_records_and_counts_the_prompts_its_budget_held_whole(name, tmp_path, monkeypatch, capsys):
    main, data, prompts = RUNS[name]
    _stand_in(monkeypatch)
    save = tmp_path / "out"
    main(data(tmp_path / "data") + ["--method", "snapkv", "fullkv", "--max_capacity_prompts", "64", "4096",
                                    "--max_new_tokens", "2", "--save_dir", str(save)])
    by_label = _records(save)
    evicted = {label: {r["prompt_evicted"] for r in rs} for label, rs in by_label.items()}
    assert evicted == {"snapkv_64": {True}, "snapkv_4096": {False}, "fullkv": {False}}, evicted
    assert all(r["prompt_tokens"] < 4096 for rs in by_label.values() for r in rs)
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("budget >= prompt length")]
    assert line.endswith(f"): snapkv_4096 {prompts} of {prompts} prompts"), line


@pytest.mark.parametrize("name", list(RUNS))
def test_ctrl_c_is_one_line_and_the_same_command_resumes(name, tmp_path, monkeypatch, capsys):
    main, data, prompts = RUNS[name]
    calls = []

    def decode(model, tok, batch, configs, n, sweep=True):
        calls.append(len(batch))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return [(["42"] * len(batch), None) for _ in configs]

    monkeypatch.setattr(loop, "decode_configs", decode)
    argv = data(tmp_path / "data") + ["--method", "snapkv", "--max_new_tokens", "2", "--save_dir",
                                      str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    code = exit_.value.code
    del exit_
    gc.collect()  # as the process ends: nothing of the run (its progress bar) is drawn after the last line
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert err.rstrip().splitlines()[-1] == "interrupted: rerun the same command to resume", err[-500:]
    assert sum(map(len, _records(tmp_path / "out").values())) == 1  # the prompt finished before Ctrl-C
    main(argv)
    assert sum(calls) == prompts + 1  # the rerun decoded only the prompts not yet written
    assert [len(rs) for rs in _records(tmp_path / "out").values()] == [prompts]
