"""Sharded runs: per-process parts, the merge, and a 2-process ``accelerate launch`` of the needle runner."""

import pytest

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil

import run_needle_in_haystack as cli
from restkv.bench import loop, shard
from restkv.bench.results import JsonlWriter, read_jsonl
from helpers import ROOT

FIELDS = ("id", "cfg")


def _write_sharded(path, keys, size, stop=None):
    """Write the records of ``keys`` the way ``size`` processes do (rank = index % size); ``stop``: records per part."""
    for rank in range(size):
        with shard.ResultFile(path, FIELDS, keys, shard.Shard(rank, size)) as out:
            mine = [k for i, k in enumerate(keys) if i % size == rank and not out.done(k)]
            for k in mine[:stop]:
                out.write({"id": k[0], "cfg": k[1], "value": f"{k[0]}{k[1]}"})


def test_merge_equals_single_process_file_and_resumes(tmp_path):
    keys = [(i, c) for i in range(7) for c in ("a", "b")]
    single = tmp_path / "single.jsonl"
    _write_sharded(str(single), keys, 1)
    path = str(tmp_path / "r.jsonl")
    _write_sharded(path, keys, 3, stop=2)  # every process stops early
    with open(shard.part_path(path, shard.Shard(1, 3)), "a") as fh:
        fh.write('{"id": 6, "cf')  # a write cut short
    assert not os.path.exists(path)
    _write_sharded(path, keys, 3)  # the rerun completes each part
    assert shard.merge(path) == len(keys)
    assert open(path).read() == single.read_text()
    assert sorted(os.listdir(tmp_path)) == ["r.jsonl", "single.jsonl"]  # parts and plan removed
    # a later sharded run appends its new records in plan order after the merged ones
    more = keys + [(7, "a"), (7, "b"), (8, "a")]
    _write_sharded(path, more, 2)
    assert shard.merge_all(str(tmp_path)) == {path: 3}
    assert [(r["id"], r["cfg"]) for r in read_jsonl(path)] == more


def test_single_process_run_takes_over_left_parts_and_merge_command(tmp_path):
    keys = [(i, "a") for i in range(5)]
    path = str(tmp_path / "sub" / "r.jsonl")
    _write_sharded(path, keys, 2, stop=1)
    assert shard.main(["merge", str(tmp_path)]) == {path: 2}
    _write_sharded(path, keys, 2, stop=1)
    with shard.ResultFile(path, FIELDS, keys, shard.Shard()) as out:  # merges the parts first
        assert [out.done(k) for k in keys] == [True, True, True, True, False]
    assert [r["id"] for r in read_jsonl(path)] == [0, 1, 2, 3]
    with JsonlWriter(path, FIELDS) as w:
        assert len(w) == 4


ARGS = ["--method", "fullkv", "streamingllm", "--max_capacity_prompts", "64", "--needles", "passkey",
        "--context_lengths", "300", "--depth_percents", "0:100:20", "--max_new_tokens", "4", "--no_plots"]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "run_needle_in_haystack.py"]


def _lines(path):
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as fh:
        return fh.read().count(b"\n")


def _worker(launcher, rank):
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "run_needle_in_haystack.py" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            pass
    return None


@pytest.mark.slow
def test_two_process_launch_killed_and_rerun_equals_one_process(tmp_path):
    _, reference, _ = cli.main(ARGS + ["--save_dir", str(tmp_path / "one")])
    assert len(reference) == 12
    save = tmp_path / "two"
    path = save / "smollm2-135m" / "results.jsonl"
    part1 = f"{path}.part-001-of-002"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    argv = LAUNCH + ARGS + ["--save_dir", str(save)]
    launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and launcher.poll() is None and _lines(part1) < 2:
            time.sleep(0.05)
        worker = _worker(launcher, 1)
        assert launcher.poll() is None and worker is not None, "the run ended before a process could be killed"
        worker.send_signal(signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    before = {f: _lines(f"{path}.part-{f:03d}-of-002") for f in (0, 1)}
    assert 2 <= before[1] < 6 and not path.exists()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    todo = {int(r): int(n) for r, n in re.findall(r"process (\d) of 2\): (\d+) records to run", done.stderr)}
    assert todo == {0: 6 - before[0], 1: 6 - before[1]}
    merged = list(read_jsonl(path))
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert strip(merged) == strip(reference)
    assert sorted(os.listdir(path.parent)) == ["results.jsonl", "run_meta.json"]
    assert json.load(open(path.parent / "run_meta.json"))["processes"] == 2


def test_longbench_shards_merge_into_the_single_process_files(tmp_path, monkeypatch):
    import run_longbench
    from helpers import write_fixture

    def fake_decode(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
        return [([f"{len(p)}:{c['method']}" for p in prompts], None) for c in configs]

    monkeypatch.setattr(loop, "decode_configs", fake_decode)
    monkeypatch.setattr(shard.Shard, "barrier", lambda self: None)
    data = write_fixture(tmp_path / "data", ["hotpotqa", "trec"], n=3, words=5)
    argv = ["--data_dir", data, "--datasets", "hotpotqa", "trec", "--method", "snapkv", "fullkv",
            "--max_capacity_prompts", "64", "--max_new_tokens", "2"]
    single = run_longbench.main(argv + ["--save_dir", str(tmp_path / "one")])
    for rank in (1, 0):  # the main process finishes last and merges
        monkeypatch.setattr(loop, "current", lambda rank=rank: shard.Shard(rank, 2))
        sharded = run_longbench.main(argv + ["--save_dir", str(tmp_path / "two")])
    assert list(sharded) == list(single) and len(single) == 4
    for key, path in single.items():
        assert open(sharded[key]).read() == open(path).read() and _lines(path) == 3, key
        assert sorted(os.listdir(os.path.dirname(sharded[key]))) == ["fullkv.jsonl", "snapkv_64.jsonl"]
