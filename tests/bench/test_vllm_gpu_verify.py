"""benchmarks/vllm_gpu_verify.py without a GPU: its plan (every backend x runner x graph mode, then
gpu_check.py), how an arm's exit status and output read, its one line and exit status 2 without
CUDA, and vllm_check's reading of a differing token (tests/vllm_plugin/test_benchmarks.py reads each
arm's keywords with vLLM's own config classes)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import vllm_check  # noqa: E402
import vllm_gpu_verify as verify  # noqa: E402


def _plan(*flags: str) -> list:
    return verify.arms(argparse.Namespace(
        model="M", reference="/r/python", out=ROOT / "r.md", knobs=verify.KNOBS, head_knobs=verify.HEAD_KNOBS,
        prompt_len=4000, new_tokens=160, gpu_check=" ".join(flags),
    ))  # fmt: skip


def test_plan_covers_every_backend_runner_and_graph_mode():
    plan = _plan("--lengths", "32768")
    runners = ("0", "1")  # no vLLM here: the runners of a release with both (VLLM_USE_V2_MODEL_RUNNER)
    assert verify.runners() == verify.BOTH_RUNNERS
    wanted = set(itertools.product(verify.BACKENDS.values(), runners, ("graphs", "eager")))
    seen, heads = set(), set()
    for _, cmd, env in plan[:-1]:
        engine = json.loads(cmd[cmd.index("--engine") + 1])
        assert set(engine) <= set(vllm_check.ENGINE_KEYS)  # vllm_check passes each on to LLM(...)
        graphs = "eager" if engine.get("enforce_eager") else engine["compilation_config"]["cudagraph_mode"]
        arm = (engine["attention_config"]["backend"], env["VLLM_USE_V2_MODEL_RUNNER"], graphs)
        knobs = cmd[cmd.index("--knobs") + 1]
        if knobs == verify.HEAD_KNOBS:  # per-head budgets: Triton, each runner, head-major pages
            assert env["VLLM_KV_CACHE_LAYOUT"] == "HND" and len(env) == 2
            assert cmd[cmd.index("--reference_json") + 1].endswith("r.heads.reference.json")
            heads.add(arm)
        else:
            assert knobs == verify.KNOBS and cmd[cmd.index("--reference_json") + 1].endswith("r.reference.json")
            seen.add(arm)
        assert cmd[cmd.index("--reference") + 1] == "/r/python" and cmd[cmd.index("--model") + 1] == "M"
    assert seen == {(b, r, "eager" if g == "eager" else "PIECEWISE") for b, r, g in wanted}
    assert heads == {("TRITON_ATTN", r, g) for r in runners for g in ("PIECEWISE", "eager")}
    assert len(plan) == len(wanted) + len(heads) + 1
    assert plan[-1][1] == ["/r/python", str(ROOT / "benchmarks" / "gpu_check.py"), "--lengths", "32768"]


def test_an_arm_reads_pass_fail_or_not_run():
    assert verify.outcome(0, "all checks passed\n", "") == (verify.PASSED, "")
    refused = "not run: Selected backend FLASHINFER is not valid for this configuration. Reason: [...]"
    assert verify.outcome(vllm_check.NOT_RUN, f"{refused}\n", "") == (verify.NOT_RUN, refused[9:])
    out = "tokens, plugin: [1]\nFAIL blocks held: plugin: step 3\nFAIL eviction: nothing\n1 checks failed\n"
    assert verify.outcome(1, out, "") == (verify.FAILED, "blocks held: plugin: step 3; eviction: nothing")
    assert verify.outcome(137, "", "Traceback\nKilled\n") == (verify.FAILED, "exit status 137: Killed")


def test_without_cuda_one_line_and_status_2(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vllm_gpu_verify.py"), "--model", "M", "--out", str(tmp_path / "r.md")],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout.startswith("no CUDA device") and len(done.stdout.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_check_reads_a_differing_token_as_a_tie_by_vllms_margin():
    """``vllm_check``: the first differing token passes when the reference's token is within the
    tie of vLLM's own by vLLM's logprobs (keys as JSON gives them), and nothing after it counts."""
    logprobs = [{"5": -0.1}, {"6": -0.5, "7": -0.6}, {"8": -0.1}]
    assert vllm_check._tokens([5, 6, 8], [5, 7, 9], logprobs, tie=0.25) is None
    assert "token 1" in vllm_check._tokens([5, 6, 8], [5, 7, 9], logprobs, tie=0.05)
    assert "token 1" in vllm_check._tokens([5, 6, 8], [5, 4, 8], logprobs, tie=0.25)  # not in vLLM's top
    assert "token 1" in vllm_check._tokens([5, 6, 8], [5, 7, 8], None, tie=1.0)
    assert vllm_check._tokens([5, 6, 8], [5, 6, 8], None, tie=0.0) is None


def test_report_holds_each_arm_and_the_status_reads_the_worst(tmp_path, monkeypatch):
    """The run loop on stand-in arms (CUDA said present): one table row each, the report written,
    exit status 1 with a failure, 3 with only a not-run arm besides passes."""
    import torch

    def arm(name: str, printed: str, status: int):
        return (name, [sys.executable, "-c", f"print({printed!r}); raise SystemExit({status})"], {})

    passed = arm("a", "all checks passed", 0)
    refused = arm("b", "not run: Selected backend X is not valid for this configuration. Reason: [none]", 3)
    failed = arm("c", "FAIL tokens differ: token 2", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(verify, "versions", lambda: "a GPU")
    (tmp_path / "config.json").write_text("{}")
    for plan, status in (([passed, refused, failed], 1), ([passed, refused], 3), ([passed], 0)):
        monkeypatch.setattr(verify, "arms", lambda args, plan=plan: plan)
        assert verify.main(["--model", str(tmp_path), "--out", str(tmp_path / "r.md")]) == status
    monkeypatch.setattr(verify, "arms", lambda args: [passed, refused, failed])
    verify.main(["--model", str(tmp_path), "--out", str(tmp_path / "r.md")])
    rows = [x for x in (tmp_path / "r.md").read_text().splitlines() if x.startswith("| ") and "result" not in x]
    assert rows == [
        "| a | pass |  |",
        "| b | not run | Selected backend X is not valid for this configuration. Reason: [none] |",
        "| c | FAIL | tokens differ: token 2 |",
    ]
