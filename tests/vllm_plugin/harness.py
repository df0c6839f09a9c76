"""What the vLLM plugin's tests share: the packaged model's prompt, one engine run (``benchmarks/vllm_check.py``'s
``run_spec``, in a subprocess: one process running engine after engine, ``engine_loop.py``, where nothing
process-wide sets the engine apart) and restkv's transformers path (``reference.py --loop``, one process in
restkv's own environment: ``RESTKV_PYTHON``, default ``.venv/bin/python``), each cached for the session."""

from __future__ import annotations

import atexit
import collections
import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
PROMPT_LEN = 300
NEW_TOKENS = 16
BLOCK = 32
CHUNK = (
    142  # prefill tokens per step: 300 = 142 + 142 + 16, the last chunk inside the 32-token window
)
SNAPKV = {"method": "snapkv", "max_capacity_prompt": 128, "window_size": 32}
RESTKV = {"preset": "paper", "max_capacity_prompt": 128}
H2O = {"method": "h2o", "max_capacity_prompt": 128, "window_size": 32}
DECODING = {**SNAPKV, "decode_interval": 32}
TP3_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0"}  # three ranks on two cores
TWO_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # two ranks (two pipeline stages), a core each


class Cores:
    """A lock over the machine's cores, in ``folder``, that processes (xdist's workers) share: a test that takes
    every core holds it alone, any other shares it. One waiting to hold it alone goes first: later sharers wait
    behind it (``turn``), so that a stream of sharers never keeps it waiting."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.turn, self.lock = folder, folder / "turn", folder / "cores"

    def hold(self, alone: bool) -> int:
        """Block until held -> the descriptor to ``release``."""
        turn = os.open(self.turn, os.O_RDWR | os.O_CREAT)
        held = os.open(self.lock, os.O_RDWR | os.O_CREAT)
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        os.close(turn)
        return held

    def release(self, held: int) -> None:
        os.close(held)  # closing the descriptor releases its lock


def _restkv_python() -> str:
    python = os.environ.get("RESTKV_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    if not Path(python).exists():
        pytest.skip(
            f"restkv's own environment is needed for the reference (RESTKV_PYTHON={python})"
        )
    return python


def _run(cmd: list[str], env: dict) -> str:
    done = subprocess.run(
        cmd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise AssertionError(f"{cmd[1]} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def text_ids(model: str = "smollm2-135m") -> list[int]:
    """The first 800 tokens of ``prompt_text.md`` (a fixed text, an early version of the README's
    opening, so that the tests' prompts do not change with the README) by packaged ``model``'s tokenizer,
    the model converted, by restkv's environment."""
    code = (
        "import json; from restkv.bench.models import load_model; "
        f"_, t = load_model({model!r}); "
        f"print(json.dumps(t(open({str(HERE / 'prompt_text.md')!r}).read())['input_ids'][:800]))"
    )
    ids = json.loads(_run([_restkv_python(), "-c", code], {}).strip().splitlines()[-1])
    assert len(ids) == 800
    return ids


_RUNS: dict = {}


def engine_run(model_dir: str, prompts: list, knobs: dict | None, new_tokens=NEW_TOKENS, env=None, **vllm) -> dict:
    """Greedy tokens, kept positions and block counts of one engine on ``prompts`` (cached):
    ``benchmarks/vllm_check.py``'s ``run_spec`` in a subprocess, eager, chunks of ``CHUNK`` tokens,
    unless ``vllm`` says otherwise."""
    from vllm_check import run_in_subprocess

    vllm = {"enforce_eager": True, "max_num_batched_tokens": CHUNK, **vllm}
    key = json.dumps([knobs, prompts, new_tokens, env, vllm], sort_keys=True)
    if key not in _RUNS:
        spec = {"model": model_dir, "prompts": prompts, "max_tokens": new_tokens, "block_size": BLOCK}
        spec.update({"kv_tokens": 4096, **vllm})
        _RUNS[key] = _LOOP.run(spec, knobs) if in_loop(spec, env) else run_in_subprocess(spec, knobs, env)
    return _RUNS[key]



def one_after_another(model_dir: str, knobs: dict, requests: list, new_tokens=NEW_TOKENS, env=None, **vllm) -> list:
    """``requests`` ([prompt, its own knobs, None: the engine's]) served by one engine of ``knobs``, each
    once the one before has finished (give each a prompt of its own: no prefix cached for the next) ->
    per request its ``kept`` and ``tokens``. Each request's knobs must resolve to the config they give
    alone (``per_request.resolve``: nothing of the engine's carried into it), every block be back at the end."""
    ranks = vllm.get("tensor_parallel_size", 1)
    for _, own in requests:
        if own is not None:
            assert served_as(model_dir, knobs, own, ranks) == served_as(model_dir, own, None, ranks), own
    prompts = [requests[0][0], *({"ids": p} for p, _ in requests[1:])]
    run = engine_run(model_dir, prompts, knobs, new_tokens, env, request_knobs=[k for _, k in requests], **vllm)
    assert run["steps"][-1][1] == run["free_at_start"], "every block back in the pool"
    return [{"kept": kept, "tokens": tokens} for kept, tokens in zip(run["kept"], run["tokens"])]


def served_as(model_dir: str, knobs: dict, own: dict | None, ranks: int) -> dict:
    """The config (as a dict) a request of ``own`` knobs (None: the engine's) runs on an engine of ``knobs``
    over ``ranks`` tensor-parallel ranks (``restkv.vllm.per_request``)."""
    from restkv.config import CompressionConfig
    from restkv.vllm import memory, per_request, settings

    model = memory.model_of(model_dir, "float32").per_rank(ranks)
    cfg = CompressionConfig.from_kwargs(**knobs)
    settings.bind_model(cfg, model.layers, model.heads * ranks, model.kv_heads * ranks, ranks)
    return per_request.resolve(per_request.Engine(cfg, model, 1, 1024, CHUNK, BLOCK, ranks), own).as_dict()


def in_loop(spec: dict, env: dict | None) -> bool:
    """An engine ``engine_loop.py`` runs: one process, eager (no compiled graphs kept from an engine
    before), the KV cache at the model's dtype, without an environment of its own or other processes
    (tensor or pipeline ranks)."""
    ranks = spec.get("tensor_parallel_size", 1) * spec.get("pipeline_parallel_size", 1)
    return env is None and ranks == 1 and spec["enforce_eager"] and spec.get("kv_cache_dtype", "auto") == "auto"


class _Loop:
    """A process answering one JSON line at a time with a ``RESULT`` line (``engine_loop.py``, ``reference.py
    --loop``): started at the first run and again after a run fails."""

    def __init__(self, command, env: dict):
        self.command, self.env = command, env
        self.proc: subprocess.Popen | None = None

    def run(self, *request) -> dict:
        if self.proc is None:
            self.proc = subprocess.Popen(
                self.command(), env={**os.environ, "PYTHONPATH": str(ROOT), **self.env},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            )  # fmt: skip
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        watchdog = threading.Timer(1800, self.proc.kill)
        watchdog.start()
        tail: collections.deque = collections.deque(maxlen=80)
        try:
            for line in self.proc.stdout:
                if line.startswith("RESULT "):
                    return json.loads(line[7:])
                if line.startswith("FAILED "):
                    raise RuntimeError(f"{self.proc.args[1]} failed:\n{json.loads(line[7:])}")
                tail.append(line)
            raise RuntimeError(f"{self.proc.args[1]} exited:\n" + "".join(tail))
        except BaseException:
            self.close()
            raise
        finally:
            watchdog.cancel()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_LOOP = _Loop(lambda: [sys.executable, str(HERE / "engine_loop.py")], {"RESTKV_VLLM": ""})
_REFERENCE = _Loop(lambda: [_restkv_python(), str(HERE / "reference.py"), "--loop"], {})
atexit.register(_LOOP.close)
atexit.register(_REFERENCE.close)


_REFS: dict = {}


def reference(prompt: list[int], knobs: dict, new_tokens=NEW_TOKENS, model: str = "smollm2-135m") -> dict:
    """restkv's transformers path on ``prompt`` (packaged ``model``): tokens and each layer's kept positions
    [Hkv][B] (None: a layer it does not evict)."""
    key = json.dumps([knobs, prompt, new_tokens, model], sort_keys=True)
    if key not in _REFS:
        _REFS[key] = _REFERENCE.run(knobs, new_tokens, prompt, model)
    return _REFS[key]


def failing(tmp_path, prompt_len: int, layer: int) -> dict:
    """The environment of an engine (or server) whose worker raises in layer ``layer``'s eviction of every
    request of ``prompt_len`` prompt tokens: a ``sitecustomize`` each of its processes imports at start."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "from restkv.vllm import worker\n"
        "layer = worker.Worker._request_layer\n"
        "def failing(self, name, s, *args):\n"
        f"    if s.prompt_len == {prompt_len} and '.layers.{layer}.' in name:\n"
        "        raise RuntimeError('a fault made by the test')\n"
        "    return layer(self, name, s, *args)\n"
        "worker.Worker._request_layer = failing\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RESTKV_VLLM"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])}


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def heads_on_pages(write_pages, counts, budgets, shares, block_size: int, free: list, rng, g, d: int, dtype,
                   step=True):
    """Requests whose KV heads hold different numbers of entries on single-head pages (``restkv.vllm.heads``),
    then a step of ``counts[r]`` tokens each: request r's heads share ``len(shares) * budgets[r]`` entries
    drawn by ``shares``, on pages of blocks popped from ``free``, written by ``write_pages(slots, keys,
    values)`` (the step's too, with ``step``) -> (the step's ``FlatBatch``, per request per head its entries
    (keys, values) [n + count, d], the step's last)."""
    import torch

    from restkv.vllm import heads

    kv_heads = len(shares)
    held, appended, entries = [], [], []
    for c, budget in zip(counts, budgets):
        lengths = rng.multinomial(kv_heads * budget, shares)
        blocks = [free.pop() for _ in range(heads.bound(budget, block_size) + 1)]
        pages = heads.HeadPages.placed(heads.Space({"layer": 0}, kv_heads).pages(blocks), lengths, block_size)
        kv = [tuple(torch.randn(n + c, d, generator=g).to(dtype) for _ in range(2)) for n in lengths]
        for h, (k, v) in enumerate(kv):
            write_pages(torch.from_numpy(pages.slots(h, 0, lengths[h])), k[:-c], v[:-c])
        slots = pages.append(c)  # the step's tokens, on pages of their own
        for h, (k, v) in enumerate(kv if step else ()):
            write_pages(torch.from_numpy(slots[h]), k[-c:], v[-c:])
        held.append(pages)
        appended.append(slots)
        entries.append(kv)
    return heads.FlatBatch.layers({"layer": held}, counts, "cpu", {"layer": appended})["layer"], entries


def step_entries(entries, counts) -> tuple:
    """The step's keys and values [T, Hkv, d] (``heads_on_pages``' entries: each request's last ``counts[r]``
    of each head's), in the batch's token order."""
    import torch

    keys, values = ([torch.stack([e[i][-c:] for e in kv], 1) for kv, c in zip(entries, counts)] for i in (0, 1))
    return torch.cat(keys), torch.cat(values)


def assert_each_head_attends_its_entries(out, query, entries, counts, scale: float, tol: float) -> None:
    """``out`` [T, Hq, d] for ``query`` [T, Hq, d] (requests of ``counts`` tokens, their heads' entries
    ``entries`` as ``heads_on_pages`` gives them): each KV head's query heads attend causally to that
    head's entries, against a float64 softmax."""
    import torch

    group = query.shape[1] // len(entries[0])
    start = 0
    for c, kv in zip(counts, entries):
        for h, (k, v) in enumerate(kv):
            for t in range(c):
                seen = len(k) - c + t + 1
                q = query[start + t, h * group : (h + 1) * group].double()
                w = torch.softmax(q @ k[:seen].double().T * scale, -1)
                got = out[start + t, h * group : (h + 1) * group].double()
                torch.testing.assert_close(got, w @ v[:seen].double(), rtol=tol, atol=tol)
        start += c


def cpu_isa(dtype, kv_cache_dtype: str, block_size: int = 32, head_size: int = 64) -> str:
    """The ISA vLLM's CPU backend runs a cache of ``kv_cache_dtype`` with (the test skipped where it has none:
    its FP8 needs AVX-512 or AMX)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    except NotImplementedError as e:
        pytest.skip(str(e))


def fp8_entries(shape, fp8: torch.dtype, scale: float, dtype: torch.dtype, g) -> torch.Tensor:
    """Keys or values [shape] of ``dtype`` that an FP8 cache of type ``fp8`` holds exactly at ``scale``:
    float8 values from random bytes (neither NaN nor infinite) times ``scale``, so a writer stores them
    without rounding (whichever rounding it uses) and a read through the scale gives them back."""
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    values = raw.view(fp8).float()
    values = torch.where(values.isfinite(), values, torch.zeros_like(values))
    return (values * scale).to(dtype)
