"""benchmarks/fidelity.py: variants share a run, equal the same knobs given as flags, and a rerun resumes."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import ROOT

spec = importlib.util.spec_from_file_location("fidelity", ROOT / "benchmarks" / "fidelity.py")
fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fidelity)

SMALL = ["--samples", "2", "--length", "192", "--continuation", "4", "--max_capacity_prompts", "48",
         "--window_size", "8"]


def test_bad_variant_fails_before_any_work():
    with pytest.raises(ValueError, match="variant bad: .*gqa_agg"):
        fidelity.main(SMALL + ["--variant", "bad", "gqa_agg=median"])


def test_variants_equal_flags_and_resume(tmp_path, monkeypatch):
    out = tmp_path / "study.json"
    fidelity.main(SMALL + ["--method", "snapkv", "--variant", "restkv_rank", "gqa_agg=rank", "--output", str(out)])
    kl = json.loads(out.read_text())["kl"]
    assert set(kl) == {"snapkv_48-window_size=8", "restkv_rank_48"}
    assert all(len(v) == 2 and all(x >= 0 for x in v) for v in kl.values())

    flags = tmp_path / "flags.json"
    fidelity.main(SMALL + ["--method", "restkv", "--gqa_agg", "rank", "--output", str(flags)])
    assert json.loads(flags.read_text())["kl"]["restkv_48-gqa_agg=rank-window_size=8"] == kl["restkv_rank_48"]

    out.write_text(json.dumps({"kl": {k: v[:1] for k, v in kl.items()}}))  # as if stopped after one sample
    calls, real = [], fidelity.continuation_logprobs
    monkeypatch.setattr(fidelity, "continuation_logprobs", lambda *a: calls.append(1) or real(*a))
    fidelity.main(SMALL + ["--method", "snapkv", "--variant", "restkv_rank", "gqa_agg=rank", "--output", str(out)])
    assert len(calls) == 1 and json.loads(out.read_text())["kl"] == kl


def test_disjoint_sets_do_not_overlap_and_grow_without_changing():
    span = 1000
    chosen = fidelity.disjoint_starts(60_000, span, 20, seed=1)
    held = fidelity.disjoint_starts(60_000, span, 12, seed=2, avoid=chosen)
    for a, others in ((chosen, chosen), (held, held), (held, chosen)):
        for i, s in enumerate(a):
            assert all(abs(s - t) >= span for j, t in enumerate(others) if others is not a or j != i)
    assert fidelity.disjoint_starts(60_000, span, 5, seed=1) == chosen[:5]  # more samples extend a set
    with pytest.raises(ValueError, match="--samples: 80 disjoint windows"):
        fidelity.disjoint_starts(60_000, span, 80, seed=1)


@pytest.mark.parametrize("flags, message", [
    (["--held_out_from", "1"], "--held_out_from needs --disjoint"),
    (["--disjoint", "--held_out_from", "42"], "needs a seed other than --seed"),
])
def test_held_out_flags_fail_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit):
        fidelity.main(SMALL + flags)
    assert message in capsys.readouterr().err
