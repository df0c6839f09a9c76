"""``vllm serve`` with the plugin (``restkv-vllm serve``: vLLM's own command line), answering an
OpenAI-compatible completion over HTTP on 127.0.0.1 with eviction on, configured by
``--additional-config`` alone (no environment variable), at every vLLM default."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from harness import SNAPKV, TWO_ENV, engine_run, reference

pytestmark = pytest.mark.vllm


def serve(model_dir: str, knobs: dict, *flags: str) -> list[str]:
    """``restkv-vllm serve`` of the packaged model with restkv's ``knobs`` by --additional-config."""
    command = [str(Path(sys.executable).parent / "restkv-vllm"), "serve", model_dir, "--max-model-len", "1024"]
    return command + ["--additional-config", json.dumps({"restkv": knobs}), *flags]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _refused(url: str, body: dict) -> tuple[int, dict]:
    """(HTTP status, error body) of a request the server refuses."""
    try:
        _post(url, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    raise AssertionError(f"the server answered {body}")


def _wait(url: str, server: subprocess.Popen, seconds: int = 900) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if server.poll() is not None:
            raise AssertionError(
                f"the server exited ({server.returncode}):\n{server.stdout.read()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"the server did not answer {url} in {seconds} s")


def _stop(server: subprocess.Popen) -> None:
    """Terminate the server; kill it if it has not exited within a minute."""
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()


def test_serve_answers_over_http_with_eviction(model_dir, prompt):
    from transformers import AutoTokenizer

    ref = reference(prompt, SNAPKV)
    own = {"method": "streamingllm", "max_capacity_prompt": 64}  # one request's knobs (vllm_xargs)
    own_ref = reference(prompt, {**own, "window_size": SNAPKV["window_size"]})
    plain = engine_run(model_dir, [prompt], None)
    assert ref["tokens"] != plain["tokens"][0], "the prompt must show the eviction in its tokens"
    assert own_ref["tokens"] != ref["tokens"], "the request's own knobs must show in its tokens"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RESTKV_VLLM"}
    command = serve(model_dir, SNAPKV, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32")
    command += ["--kv-cache-memory-bytes", str(4096 * 2 * 30 * 3 * 64 * 4)]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait(f"http://127.0.0.1:{port}/health", server)
        body = {
            "model": model_dir,
            "prompt": prompt,
            "max_tokens": len(ref["tokens"]),
            "temperature": 0.0,
        }
        url = f"http://127.0.0.1:{port}/v1/completions"
        answer = _post(url, body)
        status, refused = _refused(url, {**body, "vllm_xargs": {"restkv": json.dumps({"bogus": 1})}})
        own_answer = _post(url, {**body, "vllm_xargs": {"restkv": json.dumps(own)}})
        metrics = _metrics(f"http://127.0.0.1:{port}/metrics", 'restkv:evictions_total{engine="0",method="streamingllm"}')
    finally:
        _stop(server)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert answer["choices"][0]["text"] == tokenizer.decode(ref["tokens"])
    # a request's own knobs: a bad one answered 400 naming the field, the next served with its own
    assert status == 400 and "extra_args['restkv']: unknown knob bogus" in refused["error"]["message"], refused
    assert own_answer["choices"][0]["text"] == tokenizer.decode(own_ref["tokens"])
    assert metrics['restkv:evictions_total{engine="0",method="streamingllm"}'] == 1
    # the plugin's counters on vLLM's /metrics, beside vLLM's own: one eviction of 300 positions to 128
    label = '{engine="0",method="snapkv"}'
    assert metrics[f"restkv:evictions_total{label}"] == 1
    assert metrics[f"restkv:evicted_tokens_total{label}"] == len(prompt) - SNAPKV["max_capacity_prompt"]
    assert metrics[f"restkv:freed_blocks_total{label}"] >= 1
    assert metrics[f"restkv:eviction_seconds_total{label}"] > 0
    assert any(name.startswith("vllm:kv_cache_usage_perc") for name in metrics)


def _metrics(url: str, wanted: str, seconds: int = 60) -> dict:
    """The server's Prometheus series as {name with labels: value}, once ``wanted`` is among them (the
    front end records each step's stats as they arrive)."""
    deadline = time.time() + seconds
    while True:
        with urllib.request.urlopen(url, timeout=30) as response:
            lines = response.read().decode().splitlines()
        series = {}
        for line in lines:
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                series[name] = float(value)
        if any(name.startswith(wanted) for name in series) or time.time() > deadline:
            return series
        time.sleep(1)


@pytest.mark.quick
def test_serve_refuses_in_lines_before_starting(model_dir):
    """A configuration the plugin cannot run: one line per cause, exit code 2, no engine started."""
    knobs = {"method": "random", "max_capacity_prompt": 128}
    command = serve(model_dir, knobs, "--kv-cache-dtype", "int8_per_token_head", "--tensor-parallel-size", "3")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line.startswith("RESTKV_VLLM: ")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert any("--kv-cache-dtype auto" in line for line in lines)
    assert any("--tensor-parallel-size 1" in line for line in lines)
    assert "Traceback" not in done.stderr


@pytest.mark.both_cores
def test_serve_with_data_parallelism(model_dir, text_ids):
    """``--data-parallel-size 2``: two engines behind one server, each with its own scheduler and worker (eager:
    ``test_serve_answers_over_http_with_eviction`` serves at vLLM's defaults, compiled).
    Four requests at once (two at the server's knobs, two with their own) answer as restkv's transformers
    path does, and ``/metrics`` counts each request's eviction once, under the engine that ran it."""
    from transformers import AutoTokenizer

    own = {"method": "streamingllm", "max_capacity_prompt": 64, "window_size": SNAPKV["window_size"]}
    prompts = [text_ids[i * 150 : i * 150 + 300] for i in range(4)]
    knobs = [SNAPKV, own, SNAPKV, own]
    refs = [reference(p, k) for p, k in zip(prompts, knobs)]
    port = _free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "RESTKV_VLLM"}, **TWO_ENV}
    command = serve(model_dir, SNAPKV, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager")
    command += ["--kv-cache-memory-bytes", str(4096 * 2 * 30 * 3 * 64 * 4), "--data-parallel-size", "2"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(f"{url}/health", server)

        def ask(i: int) -> dict:
            own_knobs = {} if knobs[i] is SNAPKV else {"vllm_xargs": {"restkv": json.dumps(own)}}
            body = {"model": model_dir, "prompt": prompts[i], "max_tokens": len(refs[i]["tokens"]), "temperature": 0.0}
            return _post(f"{url}/v1/completions", {**body, **own_knobs})

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(4)))
        metrics = _metrics(f"{url}/metrics", "restkv:evictions_total", seconds=60)
        for _ in range(30):  # each engine's stats reach the front end as its steps end
            total = sum(v for n, v in metrics.items() if n.startswith("restkv:evictions_total{"))
            if total >= 4:
                break
            time.sleep(1)
            metrics = _metrics(f"{url}/metrics", "restkv:evictions_total")
    finally:
        _stop(server)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert [a["choices"][0]["text"] for a in answers] == [tokenizer.decode(r["tokens"]) for r in refs]

    def count(name: str, method: str) -> float:
        return sum(metrics.get(f'restkv:{name}{{engine="{e}",method="{method}"}}', 0) for e in ("0", "1"))

    assert count("evictions_total", "snapkv") == 2 and count("evictions_total", "streamingllm") == 2
    assert count("evicted_tokens_total", "snapkv") == 2 * (300 - SNAPKV["max_capacity_prompt"])
    assert {'restkv:evictions_total{engine="0",method="snapkv"}', 'restkv:evictions_total{engine="1",method="snapkv"}'} <= set(metrics)


@pytest.mark.quick
@pytest.mark.parametrize("page", ["README.md", "docs/vllm.md"])
def test_the_quick_start_evicts_at_the_models_dtype(model_dir, page):
    """The page's first commands of ``restkv-vllm serve`` as written: the prompt its curl sends is longer than
    the budget it runs (the server's, or the request's own), as the comment beside its ``/metrics`` grep says
    (so the server it starts evicts, and the grep shows it), and the server runs at the packaged model's own
    dtype (vLLM's CPU default, bfloat16, warns once per weight)."""
    from transformers import AutoTokenizer

    text = (Path(__file__).resolve().parents[2] / page).read_text(encoding="utf-8")
    (block,) = [b for b in text.split("```bash\n")[1:] if "restkv-vllm serve" in b.split("```")[0]][:1]
    block = block.split("```", 1)[0]
    knobs = json.loads(re.search(r"--additional-config '(\{.*?\})'", block).group(1))["restkv"]
    own = re.search(r'"vllm_xargs": \{"restkv": "(.*?)"\}', block)
    budget = json.loads(own.group(1).replace('\\"', '"'))["max_capacity_prompt"] if own else knobs["max_capacity_prompt"]
    lines = [x for x in block.splitlines() if x.startswith("PROMPT=")]
    script = "\n".join([*lines, 'printf %s "$PROMPT"'])
    prompt = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    tokens = AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]
    assert len(tokens) > budget, f"{page}: the quick start's prompt has {len(tokens)} tokens, its budget {budget}"
    assert f"its {len(tokens)} prompt tokens cut to {budget}" in block
    dtype = json.loads((Path(model_dir) / "config.json").read_text())["dtype"]
    assert f"--dtype {dtype}" in block
