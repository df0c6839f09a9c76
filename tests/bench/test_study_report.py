"""scripts/study/report.py: per-sample tables from each arm's results, paired differences by hand."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
from helpers import ROOT

spec = importlib.util.spec_from_file_location("study_report", ROOT / "scripts" / "study" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def test_split_label():
    assert report.split_label("restkv_paper_128") == ("restkv_paper", 128)
    assert report.split_label("snapkv_64-window_size=16") == ("snapkv", 64)
    assert report.split_label("fullkv") == ("fullkv", None)


def test_needle_arm_pairs_the_same_needles(tmp_path):
    scores = {"fullkv": [1, 1, 1, 0.5], "snapkv_128": [1, 0, 0.5, 0], "restkv_128": [1, 0.4, 1, 0],
              "restkv_paper_128": [0, 0, 0.5, 0]}
    lines = []
    for label, values in scores.items():
        for depth, value in enumerate(values):
            lines.append(json.dumps({"label": label, "needle": "passkey", "length": 2048, "depth": depth * 10.0,
                                     "score": value}))
    lines.append(json.dumps({"label": "snapkv_128", "needle": "passkey", "length": 4096, "depth": 0.0, "score": 1}))
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    table = report.load_needle(tmp_path)
    # the 4096 needle only snapkv has is left out, so every config is paired on the same 4 needles
    assert table == {"fullkv": {None: [1, 1, 1, 0.5]}, "snapkv": {128: [1, 0, 0.5, 0]},
                     "restkv": {128: [1, 0.4, 1, 0]}, "restkv_paper": {128: [0, 0, 0.5, 0]}}
    text = report.report("needle", table, lower_is_better=False, digits=3)
    diffs = [0, 0.4, 0.5, 0]  # restkv - snapkv
    m = sum(diffs) / 4
    se = math.sqrt(sum((d - m) ** 2 for d in diffs) / 3 / 4)
    assert f"| restkv | {m:+.3f} ± {se:.3f} vs snapkv |" in text  # 0.225 < 2 x 0.132: not bold
    # restkv - restkv_paper = [1, 0.4, 0.5, 0]: mean 0.475, s.e. 0.2056 -> beyond 2 s.e., bold
    assert "| restkv | **+0.475 ± 0.206 vs restkv_paper** |" in text
    assert "| fullkv | 0.875 ± 0.125 |" in text


def test_ruler_arm_scores_every_sample(tmp_path):
    rows = {"fullkv": ["7 8", "9"], "snapkv_256": ["7", "nothing"], "restkv_256": ["8 and 7", "9"]}
    for label, preds in rows.items():
        path = tmp_path / "4096" / "niah_multikey_1" / f"{label}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"index": i, "task": "niah_multikey_1", "method": label,
                                            "max_seq_length": 4096, "pred": p, "outputs": ref}) + "\n"
                                for i, (p, ref) in enumerate(zip(preds, [["7", "8"], ["9"]]))))
    table = report.load_ruler(tmp_path)
    assert table == {"fullkv": {None: [100.0, 100.0]}, "snapkv": {256: [50.0, 0.0]}, "restkv": {256: [100.0, 100.0]}}
    text = report.report("ruler", table, lower_is_better=False, digits=2)
    # restkv - snapkv = [50, 100]: mean 75, s.e. 25 -> beyond 2 s.e.
    assert "| restkv | **+75.00 ± 25.00 vs snapkv** |" in text


def test_budget_curve_draws_each_knob_set_of_a_method_as_its_own_line(tmp_path, monkeypatch):
    from visualization import plots

    assert plots.line_name({"label": "restkv_paper_128", "budget": 128}) == "restkv_paper"
    assert plots.line_name({"label": "restkv_128-use_ema=True", "budget": 128}) == "restkv-use_ema=True"
    assert plots.line_name({"label": "fullkv", "budget": None}) == "fullkv"
    drawn = []
    real = plots.plt.Axes.plot
    monkeypatch.setattr(plots.plt.Axes, "plot", lambda ax, x, y, **kw: drawn.append((kw["label"], list(y)))
                        or real(ax, x, y, **kw))
    table = {"restkv": {128: [0.2, 0.4], 256: [0.5, 0.5]}, "restkv_paper": {128: [0.0, 0.2], 256: [0.3, 0.3]},
             "fullkv": {None: [1.0, 1.0]}}
    path = report.plot(table, "t", "score", tmp_path / "curve.png", log=False)
    assert path.is_file()
    assert [name for name, _ in sorted(drawn)] == ["restkv", "restkv_paper"]  # one method, two lines
    assert sorted(drawn)[0][1] == pytest.approx([0.3, 0.5]) and sorted(drawn)[1][1] == pytest.approx([0.1, 0.3])


def test_standing_ranks_every_config_by_its_mean():
    table = {"snapkv": {128: [0.3, 0.1]}, "restkv": {128: [0.1, 0.2]}, "cam": {128: [0.1, 0.1]},
             "restkv_paper": {128: [0.5, 0.5]}, "h2o": {256: [1.0]}}
    lines = report.standing(table, [128], lower_is_better=True, digits=2)
    row = lines[-1].split(" | ")
    assert row[1:4] == ["4", "2", "4"] and row[4].startswith("cam 0.10, ")  # cam 0.1, restkv 0.15, snapkv 0.2, paper 0.5
    assert report.standing(table, [128], lower_is_better=False, digits=2)[-1].split(" | ")[3] == "1"


def test_gap_closed_is_the_share_of_the_reference_to_ceiling_gap():
    table = {"streamingllm": {128: [0.5, 0.3]}, "snapkv": {128: [0.3, 0.1, 9.0]}, "fullkv": {None: [0.0, 0.0]}}
    ceiling = {"kl": {"future_attention": {"128": [0.1, 0.1]}}}
    text = report.gap_closed(table, ceiling)
    # means over the 2 samples all have: ref 0.4, snapkv 0.2, ceiling 0.1 -> (0.4 - 0.2) / (0.4 - 0.1)
    assert "| snapkv | 0.67 |" in text and "| streamingllm | 0.00 |" in text and "fullkv" not in text


def test_degradation_pairs_each_config_across_the_two_modes(tmp_path):
    def needles(folder, scores):
        folder.mkdir()
        (folder / "results.jsonl").write_text("".join(
            json.dumps({"label": label, "needle": "passkey", "length": 2048, "depth": 10.0 * d, "score": v}) + "\n"
            for label, values in scores.items() for d, v in enumerate(values)))
        return folder

    aware = needles(tmp_path / "aware", {"fullkv": [1, 1, 1], "snapkv_128": [1, 1, 0.5], "restkv_128": [1, 0.5, 1]})
    after = needles(tmp_path / "after", {"fullkv": [1, 1, 1], "snapkv_128": [0, 0, 0.5], "restkv_128": [1, 0.5, 0],
                                         "kvzip_128": [1, 1, 1]})  # a config only one mode has is left out
    text = report.degradation("needle", report.needle_rows(aware), report.needle_rows(after), 3)
    assert "(3 samples" in text and "kvzip" not in text
    # snapkv: changes [-1, -1, 0]: mean -0.667, s.e. 0.333 -> within 2 s.e.
    assert "| snapkv | 0.833 -> 0.167 (-0.667 ± 0.333) |" in text
    assert "| fullkv | 1.000 -> 1.000 (+0.000 ± 0.000) |" in text
    assert "| restkv | 0.833 -> 0.500 (-0.333 ± 0.333) |" in text
