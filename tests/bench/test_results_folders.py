"""Results folders that never mix runs, tables and plots that say what they show, messages with the next step."""

import argparse
import csv
import json
import math
import re
import statistics

import pytest

import eval as eval_longbench
import run_ruler
from restkv.bench import cli, grid, meta
from restkv.bench.needle import report


def parse(*argv):
    return cli.add_common_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_the_backend_and_dtype_are_in_each_label_when_not_the_defaults():
    assert [label for label, _ in grid.method_configs(parse("--method", "restkv", "fullkv"))] == [
        "restkv_128", "fullkv"]
    labels = [label for label, _ in grid.method_configs(parse("--method", "restkv", "fullkv", "--attn_implementation",
                                                              "eager", "--dtype", "bfloat16"))]
    assert labels == ["restkv_128-attn_implementation=eager-dtype=bfloat16",
                      "fullkv-attn_implementation=eager-dtype=bfloat16"]
    assert cli.run_settings(parse("--attn_implementation", "eager")) == {"attn_implementation": "eager",
                                                                         "dtype": "float32"}


def test_run_meta_keeps_every_run_and_refuses_other_prompt_settings(tmp_path):
    configs = grid.configs_meta(grid.method_configs(parse("--method", "snapkv")))
    settings = {"chat_template": "auto", "max_length": None, "max_new_tokens": None}
    meta.write_metadata(str(tmp_path), parse(), {"configs": configs, "labels": ["snapkv_128"], "settings": settings})
    meta.write_metadata(str(tmp_path), parse(), {"configs": configs, "labels": ["snapkv_128"], "settings": settings})
    written = json.loads((tmp_path / "run_meta.json").read_text())
    assert len(written["runs"]) == 2 and all(r["labels"] == ["snapkv_128"] for r in written["runs"])
    other = {**settings, "max_length": 4096}
    with pytest.raises(ValueError, match=r"snapkv_128 were made with other settings \(max_length=None then, 4096 now\)"):
        meta.write_metadata(str(tmp_path), parse(), {"configs": configs, "labels": ["snapkv_128"], "settings": other})
    fresh = {"snapkv_256": grid.configs_meta(grid.method_configs(parse("--method", "snapkv", "--max_capacity_prompts",
                                                                      "256")))["snapkv_256"]}
    meta.write_metadata(str(tmp_path), parse(), {"configs": fresh, "labels": ["snapkv_256"], "settings": other})
    assert len(json.loads((tmp_path / "run_meta.json").read_text())["runs"]) == 3  # no shared label: fine


def needle_record(label, budget, score, length=1024, depth=50.0, needle="passkey", config_id="a"):
    return {"needle": needle, "label": label, "config_id": config_id, "length": length, "depth": depth,
            "method": label.split("_")[0], "budget": budget, "score": score, "rouge1_f": score / 2}


def test_the_needle_table_says_what_a_score_is_with_its_prompts_and_standard_error(capsys):
    records = [needle_record("snapkv_128", 128, s, depth=d) for s, d in ((1.0, 0), (0.0, 50), (0.5, 100))]
    records += [needle_record("fullkv", None, 1.0, depth=d, needle="sf") for d in (0, 50, 100)]
    report.show("nowhere/results.jsonl", records, plots=False)
    out = capsys.readouterr().out
    assert "needle sf: the San Francisco needle" in out and "needle passkey: a 5-digit pass key" in out
    assert "score: graded answer in [0, 1]" in out and "3 prompts per length cell, 3 per label (all)" in out
    row = next(line for line in out.splitlines() if line.startswith("snapkv_128"))
    assert row.split()[1:4] == ["0.500", "±", "0.289"]  # mean 0.5, s.e. sqrt(0.25 / 3)


def test_each_needle_table_header_stands_over_its_columns_means(capsys):
    records = [needle_record("snapkv_128", 128, s, length=L, depth=d) for L in (1024, 2048)
               for s, d in ((1.0, 0), (0.0, 50), (0.5, 100))]
    records += [needle_record("fullkv", None, 1.0, length=L) for L in (1024, 2048)]  # one prompt a cell
    table = report.summary_table(records).splitlines()
    heads = [table[0].index(h) for h in ("1024", "2048", "all")]
    for row in table[1:]:
        assert [m.start() for m in re.finditer(r"(?<!± )\b\d\.\d{3}", row)] == heads, (table[0], row)


def test_a_one_prompt_cell_shows_its_score_alone_and_the_tables_go_to_a_csv(tmp_path, capsys):
    records = [needle_record("snapkv_128", 128, 0.25, length=L) for L in (1024, 2048)]
    records += [needle_record("snapkv_128", 128, 0.75, length=2048, depth=0.0)]
    report.show(str(tmp_path / "results.jsonl"), records, plots=False)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("snapkv_128"))
    assert row.split() == ["snapkv_128", "0.250", "0.500", "±", "0.250", "0.417", "±", "0.167"]
    assert "± 0.000" not in out and "1 prompt per length cell" not in out  # the most any cell holds: 2
    with open(tmp_path / "results.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["metric", "label", "1024", "2048", "all", "all_se", "prompts"]
    assert rows[1] == ["score", "snapkv_128", "0.25", "0.5", "0.4167", "0.1667", "3"]
    assert rows[2] == ["rouge1_f", "snapkv_128", "0.125", "0.25", "0.2083", "0.0833", "3"]
    report.show(str(tmp_path / "results.jsonl"), records[:1], plots=False)
    with open(tmp_path / "results.csv", newline="") as fh:
        assert list(csv.reader(fh))[1] == ["score", "snapkv_128", "0.25", "0.25", "", "1"]  # no s.e. of one


def test_needle_plots_come_from_every_record_of_the_file(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    old = [needle_record("snapkv_128", 128, 1.0, config_id="x"), needle_record("snapkv_256", 256, 1.0)]
    new = [needle_record("snapkv_128", 128, 0.0, config_id="y")]  # same label, other settings: kept apart
    path.write_text("".join(json.dumps(r) + "\n" for r in old + new))
    pngs = report.show(str(path), new)
    names = sorted(p.rsplit("/", 1)[1] for p in pngs)
    assert names == ["budget_curve.png", "heatmaps.png"]
    out = capsys.readouterr().out
    assert "3 records, 3 configs" in out and f"table written to {tmp_path / 'results.csv'}" in out
    path.write_text("".join(json.dumps(r) + "\n" for r in new))
    pngs = report.show(str(path), new)
    assert [p for p in pngs if "heatmap" not in p][0].endswith("scores.png")  # one budget: bars, no curve


def test_eval_on_needle_results_says_how_to_tabulate_them(tmp_path, capsys):
    folder = tmp_path / "smollm2-135m"
    folder.mkdir()
    (folder / "run_meta.json").write_text(json.dumps({"benchmark": "needle"}))
    (folder / "results.jsonl").write_text(json.dumps(needle_record("fullkv", None, 1.0)) + "\n")
    with pytest.raises(SystemExit) as exit_:
        eval_longbench.main(["--results_dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert f"no LongBench predictions under {tmp_path}; {folder} holds needle results: tabulate them with " \
           f"python -m restkv.bench.needle.report {folder / 'results.jsonl'}" in err
    report.main([str(folder / "results.jsonl"), "--no_plots"])  # the hint works
    assert "fullkv" in capsys.readouterr().out


def test_the_needle_report_of_an_empty_file_says_so_in_one_line(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("")
    with pytest.raises(SystemExit) as exit_:
        report.main([str(path), "--no_plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert f"error: results: {path} holds no records (a needle run appends one per prompt it answers)" in err[0]


def test_one_prompt_per_cell_has_no_standard_error_and_the_plots_say_how_many(tmp_path, capsys, monkeypatch):
    from restkv.bench.longbench.results import write_table
    from restkv.bench.ruler.evaluate import evaluate as evaluate_ruler
    from visualization import curve, plots

    cells = {"snapkv_128": {"qasper": [0.0, 100.0], "hotpotqa": [50.0, 50.0, 80.0]}, "snapkv_256": {"qasper": [40.0]},
             "fullkv": {"qasper": [60.0], "hotpotqa": [10.0, 20.0]}}
    rows = {label: {c: sum(v) / len(v) for c, v in per.items()} for label, per in cells.items()}
    write_table(rows, ["qasper", "hotpotqa"], str(tmp_path / "results.csv"), stats=cells)
    printed = {line.split()[0]: line.split()[-2:] for line in capsys.readouterr().out.splitlines()[1:-1]}
    se = math.hypot(*(statistics.stdev(v) / math.sqrt(len(v)) for v in cells["snapkv_128"].values())) / 2
    assert printed == {"snapkv_128": ["2-3", f"±{round(se, 2)}"], "snapkv_256": ["1", "n=1"], "fullkv": ["1-2", "-"]}
    with open(tmp_path / "results.csv", newline="") as fh:
        assert [row[-1] for row in csv.reader(fh)] == ["prompts", "2-3", "1", "1-2"]
    folder = tmp_path / "ruler" / "m" / "4096" / "vt"
    folder.mkdir(parents=True)
    for budget in (128, 256):
        record = {"task": "vt", "method": f"snapkv_{budget}", "max_seq_length": 4096, "pred": "A", "index": 0,
                  "outputs": ["A", "B"], "model": "m"}
        (folder / f"snapkv_{budget}.jsonl").write_text(json.dumps(record) + "\n")
    evaluate_ruler(tmp_path / "ruler", tmp_path / "ruler.csv")
    out = capsys.readouterr().out
    assert "±0.0" not in out and all(line.endswith(" n=1") for line in out.splitlines() if "snapkv_" in line)
    titles = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: titles.append(fig.axes[0].get_title()) or path)
    curve.main([str(tmp_path / "results.csv")])
    curve.main([str(tmp_path / "ruler.csv")])
    assert titles == ["avg against the KV budget · n=1-3 prompts per cell",
                      "avg against the KV budget · n=1 prompt per cell"]


def test_run_ruler_on_a_missing_folder_points_to_the_generator(capsys, tmp_path):
    with pytest.raises(SystemExit):
        run_ruler.main(["--data_dir", str(tmp_path / "none"), "--save_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert f"error: --data_dir: {tmp_path / 'none'} is not a folder; generate the data with: bash " \
           "scripts/ruler/generate.sh" in err
    assert "python -m restkv.bench.ruler.generate" in err
