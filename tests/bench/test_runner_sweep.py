"""The runners' sweep mode (one prefill per batch, every config) writes the records of one-config-at-a-time runs."""

import pytest

import json

import run_longbench
import run_needle_in_haystack as cli
from helpers import write_fixture

VOLATILE = ("seconds",)


def strip(records):
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in records]


@pytest.mark.slow
def test_needle_sweep_equals_separate_runs(tmp_path):
    argv = ["--method", "restkv", "snapkv", "fullkv", "--max_capacity_prompts", "96",
            "--needles", "passkey", "--context_lengths", "600", "--depth_percents", "10", "70",
            "--batch_size", "2", "--max_new_tokens", "8", "--no_plots"]
    _, swept, _ = cli.main(argv + ["--save_dir", str(tmp_path / "sweep")])
    _, separate, _ = cli.main(argv + ["--no_sweep", "--save_dir", str(tmp_path / "separate")])
    assert len(swept) == 2 * 3
    assert 590 <= swept[0]["prompt_tokens"] <= 600
    assert any(r["needle_kept"] < 1 for r in swept)  # eviction did happen
    key = lambda r: (r["label"], r["depth"])  # noqa: E731
    assert sorted(strip(swept), key=key) == sorted(strip(separate), key=key)


@pytest.mark.slow
def test_longbench_sweep_equals_separate_runs(tmp_path):
    data = write_fixture(tmp_path / "data", ["hotpotqa"], n=2, words=25)
    argv = ["--data_dir", data, "--datasets", "hotpotqa", "--method", "restkv", "snapkv", "fullkv",
            "--max_capacity_prompts", "64", "--batch_size", "2", "--max_new_tokens", "6"]
    swept = run_longbench.main(argv + ["--save_dir", str(tmp_path / "sweep")])
    separate = run_longbench.main(argv + ["--no_sweep", "--save_dir", str(tmp_path / "separate")])
    assert list(swept) == list(separate) and len(swept) == 3
    for task_label, path in swept.items():
        a = [json.loads(line) for line in open(path)]
        b = [json.loads(line) for line in open(separate[task_label])]
        assert a == b and len(a) == 2, task_label


def test_needle_variant_equals_the_same_knobs_as_flags(tmp_path):
    argv = ["--max_capacity_prompts", "96", "--needles", "passkey", "--context_lengths", "600",
            "--depth_percents", "40", "--max_new_tokens", "8", "--no_plots"]
    _, both, _ = cli.main(argv + ["--method", "restkv", "--variant", "rk_paper", "preset=paper,window_size=16",
                                  "--save_dir", str(tmp_path / "variant")])
    _, flags, _ = cli.main(argv + ["--method", "restkv", "--preset", "paper", "--window_size", "16",
                                   "--save_dir", str(tmp_path / "flags")])
    by_label = {r["label"]: r for r in both}
    assert set(by_label) == {"restkv_96", "rk_paper_96"}
    (flag,) = flags
    assert flag["label"] == "restkv_96-kernel_size=5-temporal=ema-window_size=16"
    same = ("response", "score", "needle_kept", "config_id")
    assert {k: by_label["rk_paper_96"][k] for k in same} == {k: flag[k] for k in same}
