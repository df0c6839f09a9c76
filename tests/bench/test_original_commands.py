"""The original ReST-KV README's command lines and scripts, as its users type them, reach the data check.

The command lines are quoted from the original's README (github.com/an-yongqi/rest-kv); the scripts are
ours, with the original's names, positional arguments and experiment lists. With no data here each run
must get past flag parsing and stop with the one-line data-check message (exit code 2), never a traceback,
and before any work: no model loaded, no results folder created.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import run_infinite_bench
import run_longbench
import run_needle_in_haystack
import run_ruler
from helpers import ROOT, write_fixture
from restkv.bench import cli, models

# The original README, verbatim ("<path_to_model>" replaced by the test's model folder).
MINIMAL = ("bash scripts/longbench/run.sh 0 restkv 128 <path_to_model> "
           "--use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000")
CONFIGURATION = """python3 run_longbench.py \\
    --method restkv \\
    --model_path <path_to_model> \\
    --max_capacity_prompts 128 \\
    --attn_implementation flash_attention_2 \\
    --save_dir output_dir/results_longbench \\
    --use_cache True \\
    --window_size 32 \\
    --use_wo \\
    --use_ema \\
    --alpha 0.3 \\
    --metric_mode after \\
    --pooling adaptive \\
    --scale 2000"""
BENCHMARKS = ("bash scripts/longbench/run_llama3.sh", "bash scripts/longbench/eval.sh output_dir/results_longbench",
              "bash scripts/ruler/run_llama3.sh", "bash scripts/ruler/eval.sh output_dir/results_ruler",
              "bash scripts/needle/run_mistral.sh",
              "bash scripts/infinite_bench/run_llama3.sh",
              "bash scripts/infinite_bench/eval.sh output_dir/results_infinite_bench")
LONGBENCH_DATA = "--data_dir: data/longbench/narrativeqa.jsonl not found"
# What each script's runs stop at here: the data check (the needle's haystack is packaged: the context check
# of the test's 8K model).
STOPS = {"longbench": LONGBENCH_DATA, "ruler": "generate the data with: bash scripts/ruler/generate.sh",
         "infinite_bench": "--data_dir: data/infinite_bench/passkey.jsonl not found",
         "needle": "--e_len: 32000 tokens plus 32 new tokens exceed the context of"}
RUNNERS = {"run_longbench.py": run_longbench, "run_ruler.py": run_ruler, "run_infinite_bench.py": run_infinite_bench,
           "run_needle_in_haystack.py": run_needle_in_haystack}


# What a user makes in a checkout (docs/benchmarks.md generates data/ruler; the runs write their results): the
# runs here start in a folder without them, so that they stop at the data check whatever the checkout holds.
USERS = ("data", "output_dir", "results", "results_needle")


def without_users_folders(checkout: Path, into: Path) -> Path:
    """``into``, made a folder holding a link to each entry of ``checkout`` except ``USERS``."""
    into.mkdir()
    for entry in checkout.iterdir():
        if entry.name not in USERS:
            (into / entry.name).symlink_to(entry)
    return into


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    return without_users_folders(ROOT, tmp_path_factory.mktemp("clone") / "restkv")


@pytest.fixture(autouse=True)
def in_clone(clone, monkeypatch):
    """Every run and every relative path of a test starts in ``clone``: the checkout without a user's folders."""
    monkeypatch.chdir(clone)


@pytest.fixture
def fake_model(tmp_path):
    """A model folder holding only a config (128K context): anything that loads it fails."""
    path = tmp_path / "Llama-3.1-8B-Instruct"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 131072}))
    return str(path)


@pytest.fixture
def fake_8k(tmp_path):
    path = tmp_path / "Mistral-8k"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "mistral", "max_position_embeddings": 8192}))
    return str(path)


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def run(command, cwd=None, **env):
    """``command`` in a shell in ``cwd`` (default: the working folder, ``clone``), on CPU, this interpreter as
    ``python3``."""
    env = {**os.environ, "PY": sys.executable, "DEVICE": "cpu", **env}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def one_line(out, *what):
    """The run ended with exit code 2 and one error line holding ``what``; no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and all(w in errors[0] for w in what), out.stderr
    return errors[0]


def stops(capsys, main, argv, *what):
    """``main(argv)`` in process: exit code 2, the last stderr line holds ``what``."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err and all(w in err[-1] for w in what), err
    assert not any("Traceback" in line for line in err)
    return err


def test_the_minimal_example_reaches_the_data_check_and_says_where_the_data_goes(fake_model):
    out = run(MINIMAL.replace("<path_to_model>", fake_model))
    line = one_line(out, LONGBENCH_DATA, "LongBench/resolve/main/data.zip", "data/longbench/")
    assert line.startswith("run_longbench.py: error:")
    assert out.stderr.splitlines()[0] == ("no CUDA device: GPU 0 not used; running on CPU (--device cpu --dtype "
                                          "float32 --attn_implementation sdpa)")
    assert not Path("output_dir").exists()


def test_the_configuration_example_parses_and_reaches_the_data_check(capsys, fake_model, no_model):
    argv = shlex.split(CONFIGURATION.replace("<path_to_model>", fake_model).replace("\\\n", " "))[2:]
    args = run_longbench.parse_args(argv)
    assert (args.use_wo, args.use_ema, args.use_cache, args.window_size) == (True, True, True, 32)
    assert (args.alpha, args.metric_mode, args.pooling, args.scale) == (0.3, "after", "adaptive", 2000.0)
    stops(capsys, run_longbench.main, argv, LONGBENCH_DATA)


def test_the_original_data_folder_name_is_read_too(capsys, fake_model, no_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_fixture(tmp_path / "data" / "LongBench", ["qasper"])
    err = stops(capsys, run_longbench.main, ["--model_path", fake_model, "--datasets", "qasper",
                                              "--attn_implementation", "flash_attention_2"],
                "--attn_implementation flash_attention_2")
    assert not any(line.startswith("longbench:") for line in err)  # refused before the plan is printed


def test_the_benchmark_commands_reach_their_data_check(fake_model, fake_8k):
    for command in BENCHMARKS:
        script = command.split()[1]
        kind = script.split("/")[1]
        model = fake_8k if kind == "needle" else fake_model
        out = run(command, MODEL_PATH=model)
        if "eval.sh" in script:
            one_line(out, "--results_dir: output_dir/results_", "is not a folder")
        else:
            one_line(out, STOPS[kind])
            assert "no CUDA device: GPU 0 not used; running on CPU" in out.stderr
            assert "a run failed (exit 2); stopped after it" in out.stderr  # the first run; the others below


def test_data_and_results_a_user_made_in_the_checkout_are_not_seen(tmp_path, fake_model):
    """A checkout holding generated RULER data and results (as docs/benchmarks.md's commands leave it) still
    gets every run of this file to the data check: the runs start in a folder without them."""
    checkout = without_users_folders(ROOT, tmp_path / "checkout")
    data = checkout / "data" / "ruler" / "Llama-3.1-8B-Instruct" / "4096" / "niah_single_1"
    data.mkdir(parents=True)
    (data / "validation.jsonl").write_text('{"index": 0, "input": "x", "outputs": ["1"], "length": 1}\n')
    (checkout / "output_dir").mkdir()
    out = run("bash scripts/ruler/run_llama3.sh", cwd=without_users_folders(checkout, tmp_path / "clone"),
              MODEL_PATH=fake_model)
    one_line(out, STOPS["ruler"])
    assert not Path.cwd().joinpath("data").exists() and Path.cwd() != ROOT


def test_a_script_without_its_model_says_how_to_give_it():
    out = run("bash scripts/longbench/run_llama3.sh")
    assert out.returncode == 2 and "set MODEL_PATH, e.g. MODEL_PATH=" in out.stderr
    out = run("bash scripts/longbench/run.sh 0 restkv")
    assert out.returncode == 2 and "usage: bash scripts/longbench/run.sh <gpu_id> <method>" in out.stderr


def script_runs(path, model):
    """The command lines a script runs (``DRY_RUN=1``: printed, not run), on CPU."""
    out = run(f"bash {path}", MODEL_PATH=model, DRY_RUN="1")
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines() if line.startswith("python3 ")]


@pytest.mark.parametrize("path", ["scripts/longbench/run_llama3.sh", "scripts/ruler/run_llama3.sh",
                                  "scripts/infinite_bench/run_llama3.sh", "scripts/needle/run_mistral.sh"])
def test_every_experiment_of_a_script_reaches_the_data_check(capsys, path, fake_model, fake_8k, no_model):
    kind = path.split("/")[1]
    commands = script_runs(path, fake_8k if kind == "needle" else fake_model)
    original = re.search(r"EXPERIMENTS=\(\n(.*?)\n\)", (ROOT / path).read_text(), re.S).group(1)
    assert len(commands) == len(re.findall(r'^\s+"', original, re.M)) >= 2  # one run per experiment line
    for argv in commands:
        argv = [a for a in argv[1:] if a != "-u"]
        stops(capsys, RUNNERS[argv[0]].main, argv[1:], STOPS[kind])


def test_help_shows_switches_as_switches_and_each_flag_with_its_type(capsys):
    with pytest.raises(SystemExit):
        run_longbench.main(["--help"])
    text = capsys.readouterr().out
    usage = text.split("\n\n")[0]
    for switch in ("--use_wo", "--use_ema", "--use_pyramid", "--use_norm", "--use_cache"):
        assert f"[{switch}]" in usage, switch
    flat = " ".join(text.split())
    assert "--use_wo [true|false]" in flat and "[switch: --use_wo turns it on, --use_wo false off]" in flat
    assert "--alpha FLOAT" in flat and "[float, e.g. --alpha 0.3]" in flat
    assert "--max_capacity_prompts INT [INT ...], --max_capacity_prompt INT [INT ...]" in flat
    assert "[int, e.g. --max_capacity_prompts 128 512]" in flat


def test_switches_also_take_the_values_restkv_documented():
    args = run_longbench.parse_args(["--use_pyramid", "True", "--use_wo", "false", "--use_ema"])
    assert (args.use_pyramid, args.use_wo, args.use_ema) == (True, False, True)
    args = run_longbench.parse_args(["--use_wo", "--method", "restkv"])
    assert args.use_wo is True and args.method == ["restkv"]
    assert run_longbench.parse_args([]).use_wo is None  # unset: the method's own default


def test_the_original_flag_and_method_names(capsys, fake_8k, no_model):
    args = run_needle_in_haystack.parse_args(["--s_len", "1000", "--e_len", "3001", "--step", "1000", "--method",
                                              "full", "--max_capacity_prompt", "128", "--model_name", fake_8k])
    assert args.model_path == fake_8k and args.max_capacity_prompts == [128]
    from restkv.bench.needle.run import original_lengths

    assert original_lengths(args) == ([1000, 2000, 3000], "--e_len")
    stops(capsys, run_needle_in_haystack.main, ["--s_len", "1000", "--model_name", fake_8k],
          "--s_len, --e_len and --step go together")
    assert cli.parse_methods(["FullKV", "full", "SnapKV"]) == ["fullkv", "snapkv"]
    stops(capsys, run_longbench.main, ["--method", "snap_kv,rest-kv"],
          "method: unknown method 'snap_kv'; did you mean snapkv?; unknown method 'rest-kv'; did you mean restkv?")
    stops(capsys, run_longbench.main, ["--use_cache", "False"], "--use_cache: restkv always decodes on the KV cache")


def test_a_backend_this_machine_cannot_run_is_refused_before_the_plan(capsys, tmp_path, fake_model, no_model):
    import importlib.util

    import torch

    data = write_fixture(tmp_path / "data", ["qasper"])
    base = ["--model_path", fake_model, "--data_dir", data, "--datasets", "qasper", "--save_dir", str(tmp_path / "o")]
    flash = "flash-attn is not installed" if importlib.util.find_spec("flash_attn") is None else "runs on CUDA only"
    err = stops(capsys, run_longbench.main, base + ["--attn_implementation", "flash_attention_2"],
                "--attn_implementation flash_attention_2:", flash, "--attn_implementation sdpa")
    assert len(err) == 1  # the data read, then the refusal: no plan printed
    if importlib.util.find_spec("flash_attn") is None:
        assert ".[flash]" in err[-1]
    if not torch.cuda.is_available():
        stops(capsys, run_longbench.main, base + ["--device", "cuda"], "--device cuda: no CUDA device here")
    assert not (tmp_path / "o").exists()


# The paper's ReST-KV knobs as the original documents them (its README's defaults; kernel_size: its runners'
# --kernel_sizes default, which its README gives too), written out here rather than read from restkv.
PAPER = dict(window_size=32, kernel_size=5, pooling="adaptive", scale=2000.0, temporal="ema", alpha=0.3,
             metric_mode="after", use_wo=True, tau=1.0, indicator="reconstruction")
ORIGINAL_KERNEL = 5  # the original's --kernel_sizes default, which its SnapKV/PyramidKV runs used
# What the original's experiment lines set themselves (RULER and InfiniteBench: --kernel_sizes 21).
SCRIPT_KNOBS = {"longbench": {}, "needle": {}, "ruler": {"kernel_size": 21}, "infinite_bench": {"kernel_size": 21}}


def resolved_configs(argv):
    """The configs a printed runner command line resolves to: ``[(label, resolved knobs, kwargs)]``."""
    from restkv.bench import grid

    argv = [a for a in argv[1:] if a != "-u"]
    configs = grid.method_configs(RUNNERS[argv[0]].parse_args(argv[1:]))
    return [(run.label, run.cfg.as_dict(), run.kwargs) for run in map(grid.run_config, configs)], configs


@pytest.mark.parametrize("path", ["scripts/longbench/run_llama3.sh", "scripts/ruler/run_llama3.sh",
                                  "scripts/infinite_bench/run_llama3.sh", "scripts/needle/run_mistral.sh"])
def test_the_paper_scripts_run_the_papers_knobs_and_name_what_differs(path, fake_model, fake_8k):
    from restkv.bench import grid

    kind = path.split("/")[1]
    commands = script_runs(path, fake_8k if kind == "needle" else fake_model)
    seen = set()
    for argv in commands:
        configs, raw = resolved_configs(argv)
        for label, knobs, _ in configs:
            seen.add(knobs["method"])
            if knobs["method"] == "restkv":
                want = {**PAPER, **SCRIPT_KNOBS[kind]}
                assert {k: knobs[k] for k in want} == want, (path, label)
            elif "kernel_size" in knobs:
                assert knobs["kernel_size"] == ORIGINAL_KERNEL and knobs["pooling"] == "avgpool", (path, label)
        note = grid.preset_overrides(raw)
        if "restkv" in {k["method"] for _, k, _ in configs} and SCRIPT_KNOBS[kind]:
            assert note.startswith("not the preset's knobs: kernel_size=21 (preset paper: 5) in restkv_1024"), note
        else:
            assert note == "", note
    assert "restkv" in seen and "snapkv" in seen


def test_a_dry_run_says_nothing_ran_and_the_needle_hint_names_a_mistral_model(fake_model):
    out = run("bash scripts/longbench/run_llama3.sh", MODEL_PATH=fake_model, DRY_RUN="1")
    assert out.returncode == 0 and "completed" not in out.stdout
    assert out.stdout.splitlines()[-1] == "DRY_RUN=1: the command lines above were printed, not run"
    out = run("bash scripts/needle/run_mistral.sh")
    assert out.returncode == 2 and "e.g. MODEL_PATH=mistralai/Mistral-7B-Instruct-v0.3 bash" in out.stderr


@pytest.mark.parametrize("script, default", [("scripts/longbench/eval.sh", "output_dir/results_longbench"),
                                             ("scripts/infinite_bench/eval.sh", "output_dir/results_infinite_bench"),
                                             ("scripts/ruler/eval.sh", "output_dir/results_ruler")])
def test_eval_scripts_only_score_also_without_an_argument(script, default):
    out = run(f"bash {script}", DRY_RUN="1")  # not a runner: DRY_RUN does not apply; it must score at once
    one_line(out, f"--results_dir: {default} is not a folder")
    assert "records" not in out.stderr and not Path("results", "longbench").exists()


def test_the_minimal_example_records_the_papers_knobs_in_run_meta(tmp_path, monkeypatch):
    from restkv.bench import loop

    data = write_fixture(tmp_path / "data", ["qasper"], n=1, words=20)
    out = run(MINIMAL.replace("<path_to_model>", "smollm2-135m"), DRY_RUN="1")
    (argv,) = [shlex.split(line) for line in out.stdout.splitlines() if line.startswith("python3 ")]
    monkeypatch.setattr(loop, "decode_configs", lambda model, tok, prompts, configs, n, sweep=True:
                        [(["x"] * len(prompts), None) for _ in configs])
    save = tmp_path / "out"
    argv = argv[2:] + ["--data_dir", data, "--datasets", "qasper", "--save_dir", str(save)]
    run_longbench.main(argv)
    meta = json.loads((save / "smollm2-135m" / "run_meta.json").read_text())
    ((label, config),) = meta["configs"].items()
    assert label == "restkv_128-kernel_size=5-temporal=ema"
    assert {k: config["resolved"][k] for k in PAPER} == PAPER and config["configure"]["preset"] == "paper"
