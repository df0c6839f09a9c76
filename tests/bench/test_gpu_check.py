"""benchmarks/gpu_check.py on CPU (``--device cpu --tiny``): the correctness rows say equal, and its masked
full-cache reference equals the test suite's own (tests/helpers.py) on the same kept sets."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from helpers import ROOT, masked_reference_logits

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

import restkv  # noqa: E402


def test_tiny_run_prints_equal_rows_with_a_legend_after_a_warm_up_at_each_length(capsys, monkeypatch):
    order = []
    for name in ("warm_up", "settle", "timed"):
        real = getattr(gpu_check, name)

        def spy(model, *a, _real=real, _name=name, **k):
            length = a[0] if _name == "warm_up" else a[0].shape[1]
            order.append((_name, length, a[1] if _name == "timed" else None))
            return _real(model, *a, **k)

        monkeypatch.setattr(gpu_check, name, spy)
    rows = gpu_check.main(["--device", "cpu", "--tiny", "--lengths", "320"])
    checked = {row[2]: row[3] for row in rows if row[1] == gpu_check.RUNS["tiny"]["check"]}
    assert checked == {"fullkv": "reference", "snapkv": "yes", "restkv": "yes", "adakv": "yes"}
    assert {row[1] for row in rows} == {256, 320} and {row[3] for row in rows if row[1] == 320} == {"-"}
    # every method warmed at the first row's length, then each length's rows after an untimed prefill of it
    assert order[:2] == [("warm_up", 256, None), ("settle", 256, None)]
    assert order[2:6] == [("timed", 256, m) for m in ("fullkv", *gpu_check.METHODS)]
    assert order[6:8] == [("settle", 320, None), ("timed", 320, "fullkv")]
    out = capsys.readouterr().out
    assert "| sdpa | 256 | adakv | yes |" in out and "| sdpa | 256 | fullkv | reference |" in out
    assert "-0.00" not in out and out.rstrip().splitlines()[-1] == gpu_check.LEGEND.format(check=256)


def test_memory_never_reads_minus_zero():
    assert gpu_check.gib(-2e6) == "0.00" and gpu_check.gib(0) == "0.00" and gpu_check.gib(3 * 2**29) == "1.50"


def test_masked_reference_equals_the_suites():
    torch.manual_seed(0)
    model = gpu_check.build_model("tiny", "cpu", torch.float32, 512)
    ids = torch.randint(0, 256, (1, 200))
    for method in ("snapkv", "adakv"):
        restkv.configure(model, method=method, max_capacity_prompt=48)
        tokens, logits = gpu_check.greedy(model, ids, 6)
        kept = restkv.kept_positions(model)
        restkv.detach(model)
        ours = gpu_check.masked_reference(model, ids, kept, tokens, "sdpa")
        theirs = masked_reference_logits(model, ids, kept, 6)
        restkv.detach(model)
        torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            logits, ours, atol=1e-4, rtol=1e-4
        )  # the evicted run, token by token


def test_agreement_fails_on_a_clear_difference():
    ref = torch.zeros(1, 3, 5)
    ref[0, :, 1] = 1.0
    assert gpu_check.agreement(torch.tensor([[1, 1, 1]]), ref, 1e-4) == "yes"
    assert gpu_check.agreement(torch.tensor([[1, 2, 1]]), ref, 1e-4).startswith("NO (token 1")
    assert gpu_check.agreement(torch.tensor([[1, 2, 1]]), ref, 2.0) == "yes, 1 ties"


def test_without_cuda_one_line_and_status_2():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.startswith("no CUDA device: gpu_check.py") and len(done.stdout.splitlines()) == 1
