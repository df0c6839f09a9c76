"""Shared flags (original names, light imports) and the method x budget grid: labels, knobs, variants."""

import argparse
import subprocess
import sys

import pytest

from helpers import ROOT
from restkv.bench import cli, grid
from restkv.bench.needle.run import add_needle_args


def parse(*argv):
    return cli.add_common_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults_and_original_flag_names():
    args = parse()
    assert args.model_path == "smollm2-135m" and args.max_capacity_prompts is None  # 128 unless ratios are given
    assert args.attn_implementation == "sdpa" and args.dtype == "float32" and args.chat_template == "auto"
    assert args.max_length is None and all(getattr(args, k) is None for k in cli.knob_flags())
    args = parse("--method", "restkv,snapkv", "fullkv", "--use_wo", "0", "--use_ema", "true", "--alpha", "0.5",
                 "--max_capacity_prompts", "64", "256", "--pooling", "maxpool")
    assert cli.parse_methods(args.method) == ["restkv", "snapkv", "fullkv"]
    assert args.use_wo is False and args.use_ema is True and args.alpha == 0.5
    with pytest.raises(SystemExit):
        parse("--use_wo", "maybe")


def test_method_configs_grid_and_unset_knobs():
    configs = grid.method_configs(parse("--method", "restkv,fullkv", "snapkv", "--max_capacity_prompts", "64",
                                          "256", "--window_size", "16", "--kernel_size", "5", "--scale", "50"))
    suffix = "-kernel_size=5-window_size=16"
    assert [label for label, _ in configs] == ["restkv_64-kernel_size=5-scale=50.0-window_size=16",
                                               "restkv_256-kernel_size=5-scale=50.0-window_size=16", "fullkv",
                                               f"snapkv_64{suffix}", f"snapkv_256{suffix}"]
    assert dict(configs)["fullkv"] == {"method": "fullkv"}
    # each config gets the flags its method reads: SnapKV has no adaptive pooling scale
    assert dict(configs)[f"snapkv_256{suffix}"] == {"method": "snapkv", "max_capacity_prompt": 256,
                                                    "window_size": 16, "kernel_size": 5}
    with pytest.raises(ValueError, match="--use_norm: no config of this run reads it"):
        grid.method_configs(parse("--method", "restkv", "snapkv", "--use_norm", "1"))  # restkv reads it in before mode
    assert dict(grid.method_configs(parse()))["restkv_128"] == {"method": "restkv", "max_capacity_prompt": 128}
    with pytest.raises(ValueError, match="method.*quest"):
        grid.method_configs(parse("--method", "restkv,quest"))


def test_new_knob_flags_are_forwarded_only_when_set():
    args = parse("--method", "adakv", "--head_budget", "adakv", "--floor", "0.3", "--normalize", "1",
                 "--varlen", "0", "--gqa_agg", "rank", "--quant_method", "hqq", "--nbits", "2",
                 "--residual_length", "16", "--q_group_size", "32")
    ((label, kwargs),) = grid.method_configs(args)
    assert kwargs == {"method": "adakv", "max_capacity_prompt": 128, "head_budget": "adakv", "floor": 0.3,
                      "normalize": True, "varlen": False, "gqa_agg": "rank", "quant_method": "hqq", "nbits": 2,
                      "residual_length": 16, "q_group_size": 32}
    # head_budget="adakv" is adakv's own default, so it does not show in the label
    assert label == ("adakv_128-floor=0.3-gqa_agg=rank-nbits=2-normalize=True-q_group_size=32-"
                     "quant_method=hqq-residual_length=16-varlen=False")
    assert grid.quant_settings(kwargs) == {"quant_method": "hqq", "nbits": 2, "residual_length": 16,
                                             "q_group_size": 32}
    assert grid.quant_settings({"method": "snapkv"}) is None
    meta = grid.configs_meta([(label, kwargs)])[label]
    assert meta["quant"]["nbits"] == 2 and meta["knobs"]["floor"] == 0.3
    # a preset shows in the label by the knobs it sets away from the method's defaults (the paper's EMA)
    ((label, kwargs),) = grid.method_configs(parse("--preset", "paper"))
    assert label == "restkv_128-kernel_size=5-temporal=ema" and kwargs["preset"] == "paper"
    args = parse("--method", "headkv", "--head_importance", "/data/heads/llama3.json", "--headkv_beta", "1.5")
    assert grid.method_configs(args)[0][0] == "headkv_128-head_importance=llama3-headkv_beta=1.5"
    with pytest.raises(SystemExit):
        parse("--quant_method", "gptq")


def test_parse_knobs_types_and_errors():
    assert grid.parse_knobs("gqa_agg=rank, use_ema=0,alpha=0.1,window_size=16,preset=paper") == dict(
        gqa_agg="rank", use_ema=False, alpha=0.1, window_size=16, preset="paper")
    assert grid.parse_knobs("method=snapkv,head_importance=none") == dict(method="snapkv", head_importance=None)
    for bad, field in (("budget=3", "budget=3"), ("alpha=high", "alpha=high"), ("use_ema", "use_ema"),
                       ("max_capacity_prompt=64", "max_capacity_prompt")):
        with pytest.raises(ValueError, match=field):
            grid.parse_knobs(bad)


def test_variants_extend_the_grid_with_their_own_labels():
    args = parse("--method", "fullkv", "snapkv", "--max_capacity_prompts", "64", "256", "--window_size", "16",
                 "--variant", "restkv_paper", "preset=paper", "--variant", "snap_max", "method=snapkv,gqa_agg=max,window_size=8")
    configs = dict(grid.method_configs(args))
    assert list(configs) == ["fullkv", "snapkv_64-window_size=16", "snapkv_256-window_size=16", "restkv_paper_64",
                             "restkv_paper_256", "snap_max_64", "snap_max_256"]
    # a variant's knobs override the command line's; the rest apply to it too
    assert configs["restkv_paper_256"] == {"method": "restkv", "max_capacity_prompt": 256, "window_size": 16,
                                           "preset": "paper"}
    assert configs["snap_max_64"] == {"method": "snapkv", "max_capacity_prompt": 64, "window_size": 8, "gqa_agg": "max"}
    # same knobs as flags resolve to the same config under another label
    flags = dict(grid.method_configs(parse("--max_capacity_prompts", "64", "--window_size", "16", "--preset", "paper")))
    assert grid.resolved_knobs(flags["restkv_64-kernel_size=5-temporal=ema-window_size=16"]) == grid.resolved_knobs(
        configs["restkv_paper_64"])
    # variants alone: no default method (the needle runner's own default list included)
    assert [label for label, _ in grid.method_configs(parse("--variant", "a", "use_ema=1,alpha=0.1"))] == ["a_128"]
    needle = add_needle_args(cli.add_common_args(argparse.ArgumentParser()))
    assert [label for label, _ in grid.method_configs(needle.parse_args([]))] == ["restkv_128", "snapkv_128", "fullkv"]
    assert [label for label, _ in grid.method_configs(needle.parse_args(["--variant", "a", "tau=2"]))] == ["a_128"]
    for argv, what in ((("--variant", "a/b", "tau=2"), "plain file name"),
                       (("--variant", "a", "tau=2", "--variant", "a", "tau=3"), "repeat"),
                       (("--variant", "a", "alpha=0.1"), "variant a: a_128: alpha is read by method restkv only when"),
                       (("--method", "restkv", "--variant", "restkv", "use_ema=1"), "repeat"),
                       (("--variant", "w", "window_size=200"), "variant w: w_128: .*window_size")):
        with pytest.raises(ValueError, match=what):
            grid.method_configs(parse(*argv))


@pytest.mark.parametrize("argv,field", [
    (("--quant_method", "quanto", "--nbits", "3"), "nbits"),
    (("--head_budget", "adakv", "--floor", "1.5"), "floor"),
    (("--window_size", "128"), "window_size"),
    (("--method", "adakv", "--quant_method", "hqq"), "quant_method"),
])
def test_bad_knobs_fail_with_label_and_field(argv, field):
    with pytest.raises(ValueError, match=f"_128: .*{field}"):
        grid.method_configs(parse(*argv))


@pytest.mark.parametrize("module", ["cli", "grid"])
def test_flags_and_grid_import_no_torch(module):
    code = (f"import sys; import restkv.bench.{module}; "
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-2000:] + run.stdout
