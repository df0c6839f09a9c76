"""Where the benchmarks' data sets are read from: a file, a folder, a hub snapshot, the hub; and the one-line
errors when none of them has the data."""

import json

import datasets
import pytest

from restkv.bench import hubdata, models
from restkv.bench.hubdata import Source, load_rows

ROWS = [{"id": 0, "q": "a"}, {"id": 1, "q": "b"}]
SOURCE = Source("sets", "owner/sets", config="main", split="test")


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_file_per_data_set_in_the_folder(tmp_path):
    write_jsonl(tmp_path / "sets.jsonl", ROWS)
    assert load_rows(SOURCE, str(tmp_path)) == ROWS
    (tmp_path / "sets.jsonl").unlink()
    (tmp_path / "sets.json").write_text(json.dumps(ROWS), encoding="utf-8")  # a JSON list, as LongBench v2's
    assert load_rows(SOURCE, str(tmp_path)) == ROWS
    (tmp_path / "sets.json").unlink()
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "sets.parquet"))
    assert load_rows(SOURCE, str(tmp_path)) == ROWS
    assert load_rows(SOURCE, str(tmp_path / "sets.parquet")) == ROWS  # --data_dir the file itself


def test_other_stems_and_a_folder_per_data_set(tmp_path):
    write_jsonl(tmp_path / "data.jsonl", ROWS)
    assert load_rows(Source("sets", "owner/sets", stems=("sets", "data")), str(tmp_path)) == ROWS
    write_jsonl(tmp_path / "other" / "sets" / "test.jsonl", ROWS[:1])  # a folder of split files
    write_jsonl(tmp_path / "other" / "sets" / "train.jsonl", ROWS)
    assert load_rows(SOURCE, str(tmp_path / "other")) == ROWS[:1]


def test_a_hub_snapshot_with_one_config_per_task(tmp_path):
    write_jsonl(tmp_path / "main" / "test-00000.jsonl", ROWS)
    write_jsonl(tmp_path / "other" / "test-00000.jsonl", ROWS[:1])
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: test\n    path: main/test-*\n"
        "- config_name: other\n  data_files:\n  - split: test\n    path: other/test-*\n---\n", encoding="utf-8")
    assert load_rows(SOURCE, str(tmp_path)) == ROWS
    assert load_rows(Source("x", "owner/sets", config="other"), str(tmp_path)) == ROWS[:1]


def test_the_hub_when_the_folder_lacks_it(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(models, "hub_unreachable", lambda: None)

    def hub(path, name=None, **kw):
        calls.append((path, name))
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                                     "test": datasets.Dataset.from_list(ROWS)})

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert load_rows(SOURCE, str(tmp_path)) == ROWS
    assert load_rows(SOURCE, None) == ROWS
    assert calls == [("owner/sets", "main")] * 2
    err = capsys.readouterr().err
    assert "sets: not in" in err and "loaded owner/sets from the hub" in err


def test_nothing_reachable_is_one_line_with_the_download_command(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'owner/sets' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(models, "hub_unreachable", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError) as err:
        load_rows(SOURCE, str(tmp_path), flag="--data_dir")
    text = str(err.value)
    assert "\n" not in text and text.startswith("--data_dir: sets not found")
    assert f"; download it with: hf download owner/sets --repo-type dataset --local-dir {tmp_path / 'sets'}" in text
    with pytest.raises(FileNotFoundError, match="--data_dir: .*nowhere does not exist"):
        load_rows(SOURCE, str(tmp_path / "nowhere"))
    shared = Source("t", "owner/all", config="t", own_folder=False)
    with pytest.raises(FileNotFoundError, match=f"--local-dir {tmp_path}$"):
        load_rows(shared, str(tmp_path))


def test_an_unreachable_hub_reads_datasets_cache_only_at_once(tmp_path, monkeypatch):
    offline = []

    def cached(*args, **kw):  # datasets' own offline switch is on for the call
        offline.append(datasets.config.HF_HUB_OFFLINE)
        if args[0] == "owner/cached":
            return datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)})
        raise ConnectionError(f"Couldn't reach '{args[0]}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(models, "hub_unreachable", lambda: "https://huggingface.co: Name or service not known")
    monkeypatch.setattr(datasets, "load_dataset", cached)
    assert load_rows(Source("sets", "owner/cached"), str(tmp_path)) == ROWS
    with pytest.raises(FileNotFoundError) as err:
        load_rows(SOURCE, str(tmp_path))
    assert offline == [True, True] and datasets.config.HF_HUB_OFFLINE is False
    assert "the hub is unreachable (https://huggingface.co: Name or service not known) and datasets' cache has " \
           "no copy); download it with: hf download owner/sets" in str(err.value)


def test_unreadable_data_and_missing_splits_name_the_file(tmp_path):
    (tmp_path / "sets.jsonl").write_text('{"id": 0}\n{broken\n', encoding="utf-8")
    with pytest.raises(ValueError, match="sets.jsonl is not a data set datasets can read"):
        load_rows(SOURCE, str(tmp_path))
    write_jsonl(tmp_path / "b" / "sets" / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "b" / "sets" / "validation.jsonl", ROWS)
    with pytest.raises(ValueError, match="no split 'test' \\(it has"):
        load_rows(SOURCE, str(tmp_path / "b"))
    assert hubdata.locate(SOURCE, None) == (None, None)
