"""benchmarks/scaling.py --quick: every row measured at each length, memory growing linearly (not
quadratically) for the knobs whose float32 work is blocked, and the methods that need a model listed."""

from __future__ import annotations

import pytest

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import scaling  # noqa: E402


def test_exponent_is_the_log_log_slope():
    assert abs(scaling.exponent([1, 2, 4], [3.0, 6.0, 12.0]) - 1.0) < 1e-12
    assert abs(scaling.exponent([1, 2, 4], [1.0, 4.0, 16.0]) - 2.0) < 1e-12
    assert scaling.exponent([1, 2], [0.0, 1.0]) is None


@pytest.mark.slow
def test_quick_run(capsys):
    methods = [
        "snapkv",
        "restkv:query_window=64",
        "snapkv:refine_rounds=1",
        "snapkv:merge=pivot",
        "kvzip",
    ]
    rows, skipped = scaling.main(
        [
            "--quick",
            "--lengths",
            "512",
            "1024",
            "2048",
            "--methods",
            *methods,
            "--reps",
            "1",
            "--threads",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert [r["method"] for r in rows] == methods[:-1]
    assert [s for s, _ in skipped] == ["kvzip"]
    for r in rows:
        assert len(r["time"]) == len(r["peak"]) == 3
        assert r["peak_exp"] is not None and r["peak_exp"] < 1.5, (
            r,
            out,
        )  # linear in L, not quadratic
    assert "heads reduced from Llama-3-8B's 32/8" in out
    assert "| kvzip | not measured on one layer" in out
