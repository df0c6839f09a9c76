"""benchmarks/scaling.py --quick: every row measured at each length, memory growing linearly (not
quadratically) for the knobs whose float32 work is blocked, and the selections after every layer's
prefill measured on a random model (their extra over the full cache's prefill)."""

from __future__ import annotations

import pytest

import sys

from helpers import ROOT, tiny_tokenizer

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
    rows, model_rows = scaling.main(
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
            "--model-lengths",
            "512",
            "1024",
            "--tokenizer",
            tiny_tokenizer(),
        ]
    )
    out = capsys.readouterr().out
    assert [r["method"] for r in rows] == methods[:-1]
    assert [r["method"] for r in model_rows] == ["kvzip"]
    for r in rows:
        assert len(r["time"]) == len(r["peak"]) == 3
        assert r["peak_exp"] is not None and r["peak_exp"] < 1.5, (
            r,
            out,
        )  # linear in L, not quadratic
    assert "heads reduced from Llama-3-8B's 32/8" in out
    kvzip = model_rows[0]
    assert len(kvzip["peak"]) == len(kvzip["time"]) == 2
    layer_kv = 2 * 2 * 1024 * 128 * 2  # 2 KV heads, head_dim 128, bf16
    assert abs(kvzip["layer_multiple"] - kvzip["peak"][-1] / layer_kv) < 1e-9
    assert abs(kvzip["model_multiple"] - kvzip["layer_multiple"] / 2) < 1e-9  # 2 layers
    assert "selections after every layer's prefill, on a random 2-layer model" in out
    assert "| kvzip |" in out
