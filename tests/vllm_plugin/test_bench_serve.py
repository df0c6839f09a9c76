"""``benchmarks/vllm_bench_serve.py`` without a server: its argument errors (one line, exit status 2,
before any server starts), its command lines read by vLLM's own parsers, and its table built from a
saved ``vllm bench serve`` result and two ``/metrics`` readings."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from harness import ROOT  # noqa: E402  (puts benchmarks/ on sys.path)

import vllm_bench_serve as bench  # noqa: E402

pytestmark = pytest.mark.vllm

SCRIPT = str(ROOT / "benchmarks" / "vllm_bench_serve.py")


def _error(*args: str, env: dict | None = None) -> str:
    """The script's stderr for ``args``: exit status 2, one line, no server started."""
    done = subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "results:" not in done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("vllm_bench_serve.py: error: ")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--gen_output_len", "0"], "--gen_output_len must be >= 1"),
        (["--block_size", "16"], "multiple of 32"),
        (["--model", "/nonexistent/model"], "no config.json"),
        (["--knobs", "{bad"], "not JSON"),
        (["--knobs", '{"method": "fullkv"}'], "keeps every entry"),
        (["--knobs", '{"method": "snapkv", "bogus": 1}'], "unknown knob bogus"),
        (["--knobs", '{"method": "snapkv", "decode_interval": 64}'], "set per workload"),
        (["--knobs", '{"method": "snapkv", "max_capacity_prompt": 2048}'], ">= --prompts_input_len"),
        (["--server_args=--port 1234"], "--port is set by this script"),
    ],
)
def test_argument_errors(args, says):
    assert says in _error(*args)


def test_a_missing_packaged_model_is_named(tmp_path):
    assert "make vllm-install" in _error(env={"RESTKV_CACHE": str(tmp_path)})


def test_flags_vllm_lacks_are_refused_by_its_own_parsers():
    """Every command line of the default run parses with vLLM's own `vllm serve` and `vllm bench serve`
    parsers; a flag they lack, or a bad value, is refused before any server starts."""
    bench.check_commands(bench.parse_args([]))
    for extra, says in (("--server_args=--enforce-eagerx", "vllm serve of vLLM"),
                        ("--client_args=--max-concurrency abc", "invalid int value")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            bench.check_commands(bench.parse_args([extra]))


def test_every_arm_has_the_same_kv_memory():
    """Plain vLLM without restkv's config, the plugin's arm with it; decode_interval 128 only in the
    generation workload; the same --kv-cache-memory-bytes in every arm of a workload."""
    args = bench.parse_args([])
    for name, interval in (("generation", 128), ("prompts", None)):
        w = bench.workload(args, name)
        (_, plain), (_, knobs) = args.arms
        plain_cmd, _ = bench.commands(args, w, plain, 8000, ROOT, "plain")
        arm_cmd, client = bench.commands(args, w, knobs, 8000, ROOT, "arm")
        assert "--additional-config" not in plain_cmd
        config = json.loads(arm_cmd[arm_cmd.index("--additional-config") + 1])["restkv"]
        assert config.get("decode_interval") == interval and config["method"] == "snapkv"
        memory = {c[c.index("--kv-cache-memory-bytes") + 1] for c in (plain_cmd, arm_cmd)}
        assert memory == {str(w["kv_bytes"])}
        assert client[client.index("--random-input-len") + 1] == str(w["input_len"])


def _saved(tmp_path, name: str, requests_s: float, ttft: float, tpot: float) -> Path:
    """A result as ``vllm bench serve --save-result`` writes it (the keys of vLLM 0.32.0)."""
    result = {
        "date": "20261204-120000", "backend": "openai", "model_id": "m", "num_prompts": 8,
        "duration": 8 / requests_s, "completed": 8, "failed": 0, "total_input_tokens": 8192,
        "total_output_tokens": 512,
        "request_throughput": requests_s, "output_throughput": 64 * requests_s,
        "total_token_throughput": 1088 * requests_s, "max_concurrent_requests": 8,
    }  # fmt: skip
    for metric, mean in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2el", ttft + 63 * tpot)):
        for stat, factor in (("mean", 1.0), ("median", 0.9), ("std", 0.1), ("p50", 0.9), ("p99", 2.0)):
            result[f"{stat}_{metric}_ms"] = mean * factor
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(result))
    return path


def _metrics(preemptions: float, prefill: float, decode: float) -> str:
    return (
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
        "# TYPE vllm:num_preemptions_total counter\n"
        f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preemptions}\n'
        f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {prefill}\n'
        f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} 8.0\n'
        f'vllm:request_decode_time_seconds_sum{{engine="0",model_name="m"}} {decode}\n'
    )


def test_table_from_a_saved_result(tmp_path):
    before = _metrics(1.0, 1.0, 1.0)  # counts before the client are subtracted
    plain = _saved(tmp_path, "plain", 0.5, 2000.0, 100.0)
    arm = _saved(tmp_path, "arm1", 1.5, 500.0, 50.0)
    arms = {
        "plain vLLM": bench.read_result(plain, before, _metrics(28.0, 4.0, 13.0)),
        "snapkv 128": bench.read_result(arm, before, _metrics(1.0, 4.0, 4.0)),
    }
    assert arms["plain vLLM"]["preemptions"] == 27 and arms["snapkv 128"]["prefill share"] == 0.5
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in bench.table(arms).splitlines()]
    rows = {row[0]: row[1:] for row in cells}
    assert rows[""] == ["plain vLLM", "snapkv 128", "snapkv 128 / plain vLLM"]
    assert rows["requests/s"] == ["0.5", "1.5", "3.00x"]
    assert rows["output tokens/s"] == ["32", "96", "3.00x"]
    assert rows["TTFT mean (ms)"] == ["2,000", "500", "0.25x"]
    assert rows["TTFT median (ms)"] == ["1,800", "450", "0.25x"]
    assert rows["TTFT p99 (ms)"] == ["4,000", "1,000", "0.25x"]
    assert rows["TPOT p99 (ms)"] == ["200", "100", "0.50x"]
    assert rows["failed"] == ["0", "0", "-"]
    assert rows["preemptions"] == ["27", "0", "0.00x"]
    assert rows["prefill share"] == ["20.0%", "50.0%", "2.50x"]

    args = bench.parse_args([])
    w = bench.workload(args, "generation")
    run = {"server": ["s", "--port", "1"], "client": ["c", "x y"], "ready_s": 30.0, "restkv": []}
    runs = {name: {**run, "result": result} for name, result in arms.items()}
    text = bench.report(args, "generation", w, runs)
    assert f"KV pool {w['kv_bytes']} bytes" in text and "decode_interval 128" in text
    assert "  - client: `c 'x y'`" in text and text.rstrip().endswith(bench.table(arms).splitlines()[-1])


def test_the_keys_read_are_vllms():
    """The client's JSON keys and the server's metric names the table reads are those of this vLLM."""
    from vllm.benchmarks import serve
    from vllm.v1.metrics import loggers

    client = inspect.getsource(serve)
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "completed", "failed"):
        assert f'"{key}"' in client
    for pattern in ('f"mean_{metric_attribute_name}_ms"', 'f"median_{metric_attribute_name}_ms"',
                    'f"p{p_word}_{metric_attribute_name}_ms"', 'process_one_metric("ttft"',
                    'process_one_metric("tpot"'):  # fmt: skip
        assert pattern in client
    server = inspect.getsource(loggers)
    for name in ("num_preemptions", "request_prefill_time_seconds", "request_decode_time_seconds"):
        name = f"vllm:{name}"
        assert f'name="{name}"' in server
