"""``--threads``: torch's CPU threads of a run, set when its model loads; a count below 1 refused before any work."""

import argparse

import pytest
import torch

import run_math
from restkv.bench import models
from restkv.bench.cli import add_common_args


def test_threads_are_set_when_the_model_loads(monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(models, "max_context", lambda model: 8)
    before = torch.get_num_threads()
    args = add_common_args(argparse.ArgumentParser()).parse_args(["--threads", str(before + 1)])
    try:
        models.load_from_args(args)
        assert torch.get_num_threads() == before + 1
        models.load_from_args(add_common_args(argparse.ArgumentParser()).parse_args([]))  # unset: untouched
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


def test_a_thread_count_below_one_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_math.main(["--threads", "0", "--save_dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "--threads must be >= 1, got 0" in err[0]
    assert "--threads INT" in run_math.build_parser().format_help()
