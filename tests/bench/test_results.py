"""Resumable JSONL results files and reading JSONL."""

import pytest

from restkv.bench import results


def test_jsonl_writer_resumes_and_drops_a_cut_last_line(tmp_path):
    path = tmp_path / "out" / "r.jsonl"
    with results.JsonlWriter(path, ("id", "m")) as w:
        w.write({"id": 1, "m": "a", "x": 0.5})
        w.write({"id": 2, "m": "a", "x": 0.25})
        assert w.done({"id": 1, "m": "a"}) and w.done((2, "a")) and not w.done((1, "b"))
        with pytest.raises(ValueError, match="duplicate"):
            w.write({"id": 1, "m": "a"})
    with open(path, "a") as fh:
        fh.write('{"id": 3, "m": "a", "x"')  # killed mid-write
    with results.JsonlWriter(path, ("id", "m")) as w:
        assert len(w) == 2 and not w.done((3, "a"))
        w.write({"id": 3, "m": "a", "x": 1.0})
    records = list(results.read_jsonl(path))
    assert [(r["id"], r["x"]) for r in records] == [(1, 0.5), (2, 0.25), (3, 1.0)]


def test_malformed_lines_raise_with_their_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": 1}\n\n{"id": 2\n{"id": 3}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:3"):
        list(results.read_jsonl(path))
    with pytest.raises(ValueError, match=r"r\.jsonl:3"):
        results.JsonlWriter(path, ("id",))
