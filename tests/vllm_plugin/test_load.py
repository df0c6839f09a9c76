"""``restkv-vllm serve`` under bounded bursts of concurrent HTTP requests on 127.0.0.1, with the
plugin on (B=128, window 32, evicting every 32 generated tokens) and the least KV pool the plugin accepts
(blocks of 32 tokens), so that requests queue and are preempted: one server whose requests take turns at SnapKV's uniform budget,
AdaKV's per-head split and PyramidKV's per-layer budgets (their own knobs), all in one pool at once, its
own knobs Layer-DefensiveKV's (a budget shared across layers and heads; the heaviest, so that every request's
memory fits in what it left out of the pool); SnapKV over an FP8 KV cache; and SnapKV on the
packaged Gemma 3 270M, a hybrid sliding-window model (its full-attention layers evicted; a pool of 160
blocks of its six KV cache groups).

Each burst sends at once (the second staggered, in reverse order) long prompts (450 and 500
tokens), prompts sharing their first 256 tokens, short ones that never exceed the budget, a long
generation evicting while it decodes, two streamed requests whose client closes the connection
after 3 chunks, a prompt over ``--max-model-len`` (HTTP 400) and a request whose eviction the
server is made to raise in (HTTP 500, logged once, counted; the others go on). After each burst
vLLM's own ``/metrics`` say that nothing runs or waits and no KV block is in use; after both, that
the pool preempted requests, and the plugin's counters that two requests failed, none below 0.

What is compared: every request that completes is sent again alone to the same server, and its
greedy tokens must equal the burst's, all of them, unless the server logged it as preempted after
it evicted or while holding more than the budget (the plugin's ``restkv: request ... preempted
after k generated tokens`` line): such a request is computed again from its tokens and evicts
again at another point, so only its first k tokens must equal. A request preempted before its
first token, or before evicting while it held at most B entries, is computed again exactly as
before (its prompt's eviction at the same point) and is compared whole.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from harness import failing
from test_serve import _free_port, _stop, _wait, serve

pytestmark = pytest.mark.vllm

EVERY = {"max_capacity_prompt": 128, "window_size": 32, "decode_interval": 32}
KNOBS = {  # a uniform budget, per-head budgets (AdaKV's split), per-layer budgets (PyramidKV's)
    "snapkv": {"method": "snapkv", **EVERY},
    "adakv": {"method": "adakv", **EVERY},
    "pyramidkv": {"method": "pyramidkv", **EVERY},
}
MIXED = {"method": "layer_defensivekv", "value_norm": "l2", "max_capacity_prompt": 128, "window_size": 32}
FAILING = 333  # the prompt length whose eviction the server is made to raise in (``harness.failing``)
MAX_LEN, BLOCK = 640, 32
PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2's K and V bytes per token in float32
# case -> (model, the server's knobs, its pool in bytes, more flags): SmolLM2's pool the least the plugin accepts
# (``settings.most_blocks`` at MAX_LEN and vLLM's null block: 20 blocks of MAX_LEN's entries, Layer-DefensiveKV's
# 21 more for the kept ones, a layer may keep all it holds; SnapKV's 4; FP8: a byte an element); Gemma 3's of 160
# blocks, each of one KV cache group's 3 layers (K and V of 1 head of 256, float32)
CASES = {
    "mixed": ("smollm2", MIXED, 42 * BLOCK * PER_TOKEN, []),
    "snapkv-fp8": ("smollm2", KNOBS["snapkv"], 25 * BLOCK * PER_TOKEN // 4, ["--kv-cache-dtype", "fp8"]),
    "snapkv-gemma3": ("gemma3", KNOBS["snapkv"], 160 * BLOCK * 3 * 2 * 256 * 4, []),
}
PREEMPTED = re.compile(r"restkv: request (\S+) preempted after (\d+) generated tokens")


THRESHOLD = {"method": "simlayerkv"}  # a request's own knobs: a threshold, selecting at any prompt length


def own_knobs(reqs: dict, server: dict) -> dict:
    """name -> the knobs request ``name`` carries (``vllm_xargs``), or None: the server's. On the mixed server
    the completed requests take ``KNOBS`` in turn."""
    own, turn = {}, 0
    for name, (_, _, kind) in reqs.items():
        own[name] = None  # the server's
        if name.startswith("threshold"):
            own[name] = THRESHOLD
        elif kind == "complete" and server is MIXED:
            own[name] = list(KNOBS.values())[turn % len(KNOBS)]
            turn += 1
    return own


def requests(ids: list[int], per_head: bool) -> dict:
    """name -> (prompt, max_tokens, kind): ``complete``, ``drop`` (streamed, closed after 3 chunks)
    or ``too_long``."""
    shared = ids[:256]
    return {
        "long-500": (ids[:500], 48, "complete"),
        "long-450": (ids[200:650], 40, "complete"),
        "shared-296": (shared + ids[300:340], 40, "complete"),
        "shared-316": (shared + ids[500:560], 40, "complete"),
        "shared-356": (shared + ids[600:700], 40, "complete"),
        "short-60": (ids[700:760], 40, "complete"),  # 100 entries at most: never evicts
        "short-50": (ids[100:150], 64, "complete"),
        "generation": (ids[400:520], 120, "complete"),  # evicts at 152, 184, 216
        "drop-400": (ids[50:450], 200, "drop"),
        "drop-shared": (shared + ids[260:300], 200, "drop"),
        "too-long": (ids[:MAX_LEN] + ids[:8], 8, "too_long"),
        "fails": (ids[300:300 + FAILING], 16, "fails"),  # its eviction raises: HTTP 500, the others go on
        # a threshold's requests under the budget (an engine of per-head budgets serves them): they evict
        # fewer positions than the budget would, never a negative count
        **({f"threshold-{n}": (ids[n : 2 * n], 24, "complete") for n in (1, 7, 40)} if per_head else {}),
    }


class Client:
    def __init__(self, port: int, model: str):
        self.port, self.model = port, model

    def body(self, prompt: list[int], max_tokens: int, **more) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            **more,
        }

    def complete(self, prompt, max_tokens, request_id: str, knobs=None) -> tuple[int, list[int] | None]:
        more = {} if knobs is None else {"vllm_xargs": {"restkv": json.dumps(knobs)}}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(self.body(prompt, max_tokens, **more)).encode(),
            {"Content-Type": "application/json", "X-Request-Id": request_id},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return response.status, json.loads(response.read())["choices"][0]["token_ids"]
        except urllib.error.HTTPError as e:
            return e.code, None

    def drop(self, prompt, max_tokens, request_id: str, chunks: int = 3) -> tuple[int, int]:
        """A streamed request whose connection is closed after ``chunks`` chunks."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        body = json.dumps(self.body(prompt, max_tokens, stream=True))
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        conn.request("POST", "/v1/completions", body, headers)
        response = conn.getresponse()
        seen = 0
        while seen < chunks:
            line = response.readline()
            if not line:
                break
            seen += line.startswith(b"data: {")
        conn.sock.close()
        conn.close()
        return response.status, seen

    def text(self) -> str:
        """``/metrics`` as served."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as response:
            return response.read().decode()

    def metrics(self) -> dict:
        """vLLM's and the plugin's series, each summed over its labels."""
        values: dict = {}
        for line in self.text().splitlines():
            if line.startswith(("vllm:", "restkv:")):
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                values[name] = values.get(name, 0.0) + value
        return values

    def idle(self, seconds: int = 120) -> dict:
        """``/metrics`` once nothing runs or waits (an aborted stream leaves within a step)."""
        deadline = time.time() + seconds
        while True:
            m = self.metrics()
            if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0:
                return m
            assert time.time() < deadline, f"requests still running or waiting: {m}"
            time.sleep(1)


def burst(client: Client, reqs: dict, own: dict, tag: str, stagger: float) -> dict:
    """Each request of ``reqs`` (its knobs ``own``) from its own thread, ``stagger`` seconds apart -> name -> result."""
    with ThreadPoolExecutor(len(reqs)) as pool:
        futures = {}
        for name, (prompt, max_tokens, kind) in reqs.items():
            if kind == "drop":
                futures[name] = pool.submit(client.drop, prompt, max_tokens, f"{tag}-{name}")
            else:
                futures[name] = pool.submit(client.complete, prompt, max_tokens, f"{tag}-{name}", own[name])
            time.sleep(stagger)
        return {name: f.result(timeout=600) for name, f in futures.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bursts_over_http_give_each_completed_request_its_tokens(case, request, tmp_path):
    model, knobs, pool, more = CASES[case]
    model_dir, text_ids = (request.getfixturevalue(f) for f in (("model_dir", "text_ids") if model == "smollm2" else ("gemma_dir", "gemma_ids")))
    reqs = requests(text_ids, per_head=knobs["method"] != "snapkv")
    own = own_knobs(reqs, knobs)
    port = _free_port()
    flags = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", *more]
    flags += ["--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(pool)]
    flags += ["--max-num-batched-tokens", "256", "--max-num-seqs", "8"]
    command = serve(model_dir, knobs, *flags)
    command[command.index("--max-model-len") + 1] = str(MAX_LEN)
    env = failing(tmp_path, FAILING, 5)
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    client = Client(port, model_dir)
    try:
        _wait(f"http://127.0.0.1:{port}/health", server)
        results = {}
        for tag, order, stagger in [("b1", list(reqs), 0.0), ("b2", list(reqs)[::-1], 0.3)]:
            results[tag] = burst(client, {n: reqs[n] for n in order}, own, tag, stagger)
            after = client.idle()
            assert after["vllm:kv_cache_usage_perc"] == 0.0, f"{tag}: blocks still held: {after}"
        preemptions = after["vllm:num_preemptions_total"]
        assert after["restkv:failed_requests_total"] == 2, after  # one per burst
        assert min(v for k, v in after.items() if k.startswith("restkv:")) >= 0
        evicting = set(re.findall(r'restkv:evictions_total\{[^}]*method="(\w+)"\} [1-9]', client.text()))
        assert evicting >= {knobs["method"], *(k["method"] for k in own.values() if k and k is not THRESHOLD)}
        alone = {
            name: client.complete(prompt, max_tokens, f"alone-{name}", own[name])
            for name, (prompt, max_tokens, kind) in reqs.items()
            if kind == "complete"
        }
    finally:
        _stop(server)
    text = log.read_text()
    assert text.count("restkv: request cmpl-b1-fails") == 1, "the failure is logged once"
    assert "failed in its eviction, RuntimeError: a fault made by the test" in text
    assert preemptions > 0, "the pool never preempted a request: make it tighter"
    first_preempted: dict = {}
    for request_id, k in PREEMPTED.findall(text):
        tag_name = request_id.removeprefix("cmpl-").rsplit("-", 2)[0]
        first_preempted[tag_name] = min(int(k), first_preempted.get(tag_name, 1 << 30))
    compared_whole, later_differ = 0, []
    for tag, got in results.items():
        for name, (prompt, max_tokens, kind) in reqs.items():
            status, out = got[name]
            if kind == "too_long":
                assert status == 400, f"{tag} {name}"
            elif kind == "fails":
                assert status == 500, f"{tag} {name}: {status} {out}"
            elif kind == "drop":
                assert status == 200 and 0 < out, f"{tag} {name}: {out} chunks"
            else:
                assert status == 200 and alone[name][0] == 200, f"{tag} {name}"
                assert len(out) == max_tokens
                k = first_preempted.get(f"{tag}-{name}", max_tokens)
                assert out[:k] == alone[name][1][:k], f"{tag} {name} (first preempted at {k})"
                compared_whole += k == max_tokens
                if out != alone[name][1]:
                    later_differ.append(f"{tag}-{name}")
    print(
        f"preemptions {preemptions:.0f}; preempted after evicting or past the budget: "
        f"{first_preempted} (later tokens differ: {later_differ}); completed requests compared "
        f"whole: {compared_whole} of {2 * len(alone)}"
    )
    assert compared_whole >= 8, f"only {compared_whole} requests compared whole"


@pytest.mark.quick
@pytest.mark.parametrize(
    "steps, named", [(1, None), (8, 6)], ids=["in-its-prompt", "after-evicting"]
)
def test_the_log_names_a_preempted_request_that_evicts_again(steps, named):
    """What the comparison above reads, in vLLM's own scheduler stepped with made-up outputs
    (``test_scheduler_side``): a 300-token prompt preempted after its first chunk is not named
    (computed again as it was); preempted after its eviction (3 chunks) and 6 tokens, it is,
    with 6."""
    import logging

    from test_scheduler_side import MODEL, PROMPT, SNAPKV, finish, request, run, scheduler

    from restkv.vllm import hooks

    if not (MODEL / "config.json").is_file():
        pytest.skip(f"the packaged model's folder is needed for vLLM's ModelConfig: {MODEL}")
    hooks.install()
    lines: list = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("vllm.restkv")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        sched = scheduler(SNAPKV)
        req = request(sched, "a", PROMPT, max_tokens=12)
        for _ in range(steps):
            finish(sched, sched.schedule())
        sched.running.remove(req)
        sched._preempt_request(req, time.monotonic())
        run(sched)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    found = [(r, int(k)) for r, k in PREEMPTED.findall("\n".join(lines))]
    assert found == ([] if named is None else [("a", named)])
    assert req.num_output_tokens == 12
