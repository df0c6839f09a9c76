"""Shared runner machinery: flags, method grid, resumable JSONL, prompts, batched generation, metadata."""

import argparse
import json

import pytest
import torch

from restkv.bench import common


def parse(*argv):
    return common.add_common_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults_and_original_flag_names():
    args = parse()
    assert args.model_path == "smollm2-135m" and args.max_capacity_prompts == [128]
    assert args.attn_implementation == "sdpa" and args.dtype == "float32" and args.chat_template == "auto"
    assert args.max_length is None and all(getattr(args, k) is None for k in common.KNOBS)
    args = parse("--method", "restkv,snapkv", "fullkv", "--use_wo", "0", "--use_ema", "true", "--alpha", "0.5",
                 "--max_capacity_prompts", "64", "256", "--pooling", "maxpool")
    assert common.parse_methods(args.method) == ["restkv", "snapkv", "fullkv"]
    assert args.use_wo is False and args.use_ema is True and args.alpha == 0.5
    with pytest.raises(SystemExit):
        parse("--use_wo", "maybe")


def test_method_configs_grid_and_unset_knobs():
    configs = common.method_configs(parse("--method", "restkv,fullkv", "snapkv", "--max_capacity_prompts", "64",
                                          "256", "--window_size", "16", "--use_norm", "1"))
    suffix = "-use_norm=True-window_size=16"
    assert [label for label, _ in configs] == [f"restkv_64{suffix}", f"restkv_256{suffix}", "fullkv",
                                               f"snapkv_64{suffix}", f"snapkv_256{suffix}"]
    assert dict(configs)["fullkv"] == {"method": "fullkv"}
    assert dict(configs)[f"snapkv_256{suffix}"] == {"method": "snapkv", "max_capacity_prompt": 256,
                                                    "window_size": 16, "use_norm": True}
    assert dict(common.method_configs(parse()))["restkv_128"] == {"method": "restkv", "max_capacity_prompt": 128}
    with pytest.raises(ValueError, match="method.*quest"):
        common.method_configs(parse("--method", "restkv,quest"))


def test_new_knob_flags_are_forwarded_only_when_set():
    args = parse("--method", "adakv", "--head_budget", "adakv", "--floor", "0.3", "--normalize", "1",
                 "--varlen", "0", "--gqa_agg", "rank", "--quant_method", "hqq", "--nbits", "2",
                 "--residual_length", "16", "--q_group_size", "32")
    ((label, kwargs),) = common.method_configs(args)
    assert kwargs == {"method": "adakv", "max_capacity_prompt": 128, "head_budget": "adakv", "floor": 0.3,
                      "normalize": True, "varlen": False, "gqa_agg": "rank", "quant_method": "hqq", "nbits": 2,
                      "residual_length": 16, "q_group_size": 32}
    # head_budget="adakv" is adakv's own default, so it does not show in the label
    assert label == ("adakv_128-floor=0.3-gqa_agg=rank-nbits=2-normalize=True-q_group_size=32-"
                     "quant_method=hqq-residual_length=16-varlen=False")
    assert common.quant_settings(kwargs) == {"quant_method": "hqq", "nbits": 2, "residual_length": 16,
                                             "q_group_size": 32}
    assert common.quant_settings({"method": "snapkv"}) is None
    meta = common.configs_meta([(label, kwargs)])[label]
    assert meta["quant"]["nbits"] == 2 and meta["knobs"]["floor"] == 0.3
    # a preset shows in the label by the knobs it sets away from the method's defaults (the paper's EMA)
    ((label, kwargs),) = common.method_configs(parse("--preset", "paper"))
    assert label == "restkv_128-use_ema=True" and kwargs["preset"] == "paper"
    args = parse("--method", "headkv", "--head_importance", "/data/heads/llama3.json", "--headkv_beta", "1.5")
    assert common.method_configs(args)[0][0] == "headkv_128-head_importance=llama3-headkv_beta=1.5"
    with pytest.raises(SystemExit):
        parse("--quant_method", "gptq")


def test_parse_knobs_types_and_errors():
    assert common.parse_knobs("gqa_agg=rank, use_ema=0,alpha=0.1,window_size=16,preset=paper") == dict(
        gqa_agg="rank", use_ema=False, alpha=0.1, window_size=16, preset="paper")
    assert common.parse_knobs("method=snapkv,head_importance=none") == dict(method="snapkv", head_importance=None)
    for bad, field in (("budget=3", "budget=3"), ("alpha=high", "alpha=high"), ("use_ema", "use_ema"),
                       ("max_capacity_prompt=64", "max_capacity_prompt")):
        with pytest.raises(ValueError, match=field):
            common.parse_knobs(bad)


def test_variants_extend_the_grid_with_their_own_labels():
    args = parse("--method", "fullkv", "snapkv", "--max_capacity_prompts", "64", "256", "--window_size", "16",
                 "--variant", "restkv_paper", "preset=paper", "--variant", "snap_max", "method=snapkv,gqa_agg=max,window_size=8")
    configs = dict(common.method_configs(args))
    assert list(configs) == ["fullkv", "snapkv_64-window_size=16", "snapkv_256-window_size=16", "restkv_paper_64",
                             "restkv_paper_256", "snap_max_64", "snap_max_256"]
    # a variant's knobs override the command line's; the rest apply to it too
    assert configs["restkv_paper_256"] == {"method": "restkv", "max_capacity_prompt": 256, "window_size": 16,
                                           "preset": "paper"}
    assert configs["snap_max_64"] == {"method": "snapkv", "max_capacity_prompt": 64, "window_size": 8, "gqa_agg": "max"}
    # same knobs as flags resolve to the same config under another label
    flags = dict(common.method_configs(parse("--max_capacity_prompts", "64", "--window_size", "16", "--preset", "paper")))
    assert common.resolved_knobs(flags["restkv_64-use_ema=True-window_size=16"]) == common.resolved_knobs(
        configs["restkv_paper_64"])
    # variants alone: no default method (the needle runner's own default list included)
    assert [label for label, _ in common.method_configs(parse("--variant", "a", "alpha=0.1"))] == ["a_128"]
    from restkv.bench.needle import add_needle_args

    needle = add_needle_args(common.add_common_args(argparse.ArgumentParser()))
    assert [label for label, _ in common.method_configs(needle.parse_args([]))] == ["restkv_128", "snapkv_128", "fullkv"]
    assert [label for label, _ in common.method_configs(needle.parse_args(["--variant", "a", "alpha=0.1"]))] == ["a_128"]
    for argv, what in ((("--variant", "a/b", "alpha=0.1"), "plain file name"),
                       (("--variant", "a", "alpha=0.1", "--variant", "a", "alpha=0.2"), "repeat"),
                       (("--method", "restkv", "--variant", "restkv", "use_ema=1"), "repeat"),
                       (("--variant", "w", "window_size=200"), "variant w: w_128: .*window_size")):
        with pytest.raises(ValueError, match=what):
            common.method_configs(parse(*argv))


@pytest.mark.parametrize("argv,field", [
    (("--method", "headkv"), "head_importance"),
    (("--quant_method", "quanto", "--nbits", "3"), "nbits"),
    (("--floor", "1.5"), "floor"),
    (("--window_size", "128"), "window_size"),
    (("--method", "adakv", "--quant_method", "hqq"), "quant_method"),
])
def test_bad_knobs_fail_with_label_and_field(argv, field):
    with pytest.raises(ValueError, match=f"_128: .*{field}"):
        common.method_configs(parse(*argv))


def test_jsonl_writer_resumes_and_drops_a_cut_last_line(tmp_path):
    path = tmp_path / "out" / "r.jsonl"
    with common.JsonlWriter(path, ("id", "m")) as w:
        w.write({"id": 1, "m": "a", "x": 0.5})
        w.write({"id": 2, "m": "a", "x": 0.25})
        assert w.done({"id": 1, "m": "a"}) and w.done((2, "a")) and not w.done((1, "b"))
        with pytest.raises(ValueError, match="duplicate"):
            w.write({"id": 1, "m": "a"})
    with open(path, "a") as fh:
        fh.write('{"id": 3, "m": "a", "x"')  # killed mid-write
    with common.JsonlWriter(path, ("id", "m")) as w:
        assert len(w) == 2 and not w.done((3, "a"))
        w.write({"id": 3, "m": "a", "x": 1.0})
    records = list(common.read_jsonl(path))
    assert [(r["id"], r["x"]) for r in records] == [(1, 0.5), (2, 0.25), (3, 1.0)]


def test_malformed_lines_raise_with_their_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": 1}\n\n{"id": 2\n{"id": 3}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:3"):
        list(common.read_jsonl(path))
    with pytest.raises(ValueError, match=r"r\.jsonl:3"):
        common.JsonlWriter(path, ("id",))


def test_middle_truncate():
    ids = list(range(10))
    assert common.middle_truncate(ids, 20) == ids
    assert common.middle_truncate(ids, 4) == [0, 1, 8, 9]
    assert common.middle_truncate(ids, 5) == [0, 1, 2, 8, 9]
    assert common.middle_truncate(ids, 1) == [0]
    assert common.middle_truncate(torch.arange(10), 5).tolist() == [0, 1, 2, 8, 9]


def test_build_prompt_and_batched_greedy_generation(smollm2):
    model, tokenizer = smollm2
    text = "What is the capital of France?"
    wrapped = common.build_prompt(tokenizer, text, "auto")
    assert wrapped.startswith("<|im_start|>") and text in wrapped and wrapped.endswith("assistant\n")
    assert common.build_prompt(tokenizer, text, "off") == text
    with pytest.raises(ValueError, match="chat template"):
        common.build_prompt(argparse.Namespace(chat_template=None), text, "on")
    prompts = [wrapped, common.build_prompt(tokenizer, "Name a color of the sky. Answer in one word.", "on")]
    batch = common.generate_batch(model, tokenizer, prompts, max_new_tokens=6)
    single = [common.generate_batch(model, tokenizer, [p], max_new_tokens=6)[0] for p in prompts]
    assert batch == single and "Paris" in batch[0]
    assert all("<|im" not in s for s in batch)


def test_write_metadata(tmp_path):
    args = parse("--method", "restkv", "--alpha", "0.4")
    path = common.write_metadata(str(tmp_path), args, {"benchmark": "x"})
    meta = json.loads(open(path).read())
    assert meta["config"]["alpha"] == 0.4 and meta["benchmark"] == "x"
    assert set(meta["versions"]) >= {"torch", "transformers", "restkv"} and meta["versions"]["restkv"]
    assert "git_sha" in meta


def test_write_metadata_refuses_a_label_whose_knobs_changed(tmp_path):
    configs = common.method_configs(parse("--method", "restkv", "snapkv"))
    common.write_metadata(str(tmp_path), parse(), {"configs": common.configs_meta(configs)})
    common.write_metadata(str(tmp_path), parse(), {"configs": common.configs_meta(configs[1:])})  # same knobs
    meta = json.loads((tmp_path / "run_meta.json").read_text())
    assert set(meta["configs"]) == {"restkv_128", "snapkv_128"}  # the earlier label stays on record
    # the same label resolving to other knobs (as after a default changed) must not resume into old records
    changed = [("restkv_128", {"method": "restkv", "max_capacity_prompt": 128, "alpha": 0.5})]
    current = common.configs_meta(changed)
    with pytest.raises(ValueError, match=r"run_meta.json: results for restkv_128 .*alpha=0.3 then, 0.5 now"):
        common.write_metadata(str(tmp_path), parse(), {"configs": current})
