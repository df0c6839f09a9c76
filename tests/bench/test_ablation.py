"""The paper's ablation grid as knob sets, the original's --method ablation, and budgets as prompt fractions."""

import argparse
import importlib.util
import json

import pytest

from helpers import ROOT
from restkv import CompressionConfig
from restkv.bench import cli, grid

spec = importlib.util.spec_from_file_location("ablation_table", ROOT / "scripts" / "ablation" / "table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)


def parse(*argv):
    return cli.add_common_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_every_ablation_row_is_a_distinct_valid_config():
    configs = dict(grid.method_configs(parse(*table.variant_flags())))
    assert len(configs) == len(table.variants())
    resolved = {label: CompressionConfig(**kw) for label, kw in configs.items()}
    assert len(set(resolved.values())) == len(resolved)  # no two rows are the same config
    full = resolved["abl_full_128"]
    assert full == CompressionConfig(preset="paper", max_capacity_prompt=128)
    assert resolved["abl_no_lor_128"].indicator == "attn" and resolved["abl_no_lor_128"].pooling == "adaptive"
    assert resolved["abl_no_ema_128"].temporal == "mean" and resolved["abl_no_aws_128"].pooling == "none"


def test_original_ablation_method_maps_onto_the_knobs():
    def only(*argv):
        ((label, kwargs),) = grid.method_configs(parse("--method", "ablation", *argv))
        return label, CompressionConfig(**kwargs)

    _, cfg = only()  # the original's defaults: --indicator random --ts none --ss none
    assert cfg.indicator == "random" and "pooling" not in cfg
    _, cfg = only("--indicator", "attn", "--ts", "ema", "--ss", "adaptive")  # attn ignores --ts/--ss there
    assert (cfg.temporal, cfg.pooling, cfg.kernel_size) == ("mean", "avgpool", 5)
    label, cfg = only("--indicator", "reconstruction", "--ts", "inv-ema", "--ss", "maxpool")
    assert (cfg.temporal, cfg.alpha, cfg.pooling, cfg.kernel_size, cfg.tau) == ("inv-ema", 0.3, "maxpool", 5, 1.0)
    assert label.startswith("ablation_128")
    _, cfg = only("--indicator", "reconstruction", "--ts", "none")
    assert cfg.temporal == "last"


def test_budgets_as_fractions_of_the_prompt():
    configs = grid.method_configs(parse("--method", "restkv", "fullkv", "--max_capacity_prompts_ratio", "0.1", "0.25"))
    assert [label for label, _ in configs] == ["restkv_r0.1", "restkv_r0.25", "fullkv"]
    assert dict(configs)["restkv_r0.25"] == {"method": "restkv", "max_capacity_prompt_ratio": 0.25}
    both = grid.method_configs(parse("--max_capacity_prompts", "-1", "--max_capacity_prompts_ratio", "0.2"))
    assert [label for label, _ in both] == ["restkv_r0.2"]  # the original's -1 means "use the ratio"
    with pytest.raises(ValueError, match="max_capacity_prompts_ratio: ratios must be in"):
        grid.method_configs(parse("--max_capacity_prompts_ratio", "1.5"))
    with pytest.raises(ValueError, match="--max_capacity_prompts: each budget must be >= 1"):
        grid.method_configs(parse("--max_capacity_prompts", "0"))


def test_tables_render_in_the_papers_layout(tmp_path):
    names = table.variants()
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps({"kl": {f"{n}_128": [0.1 + i / 100, 0.2] for i, n in enumerate(names)}}))
    text = table.render(table.fidelity_scores(str(path)), 128, "KL", table._fmt(4))
    for row in ("attention top-k", "w/o LOR", "w/o EMA", "w/o AWS", "ReST-KV", "attn-v", "inv-ema", "maxpool"):
        assert row in text
    assert "-" not in text.split("\n")[4].split("|")[2]  # a value, not a missing cell


def test_the_original_comparison_pairs_are_valid_configs():
    spec = importlib.util.spec_from_file_location("original_compare", ROOT / "benchmarks" / "original_compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    for name, (cls, kwargs), knobs in compare.PAIRS:
        cfg = CompressionConfig(max_capacity_prompt=256, gqa_agg="none", **knobs)
        assert cls in ("RestKVCluster", "AblationCluster", "SnapKVCluster") and cfg.window_size == 32, name
