"""Run metadata: versions and config, and refusing a rerun whose labels changed knobs."""

import argparse
import json

import pytest

from restkv.bench import cli, grid, meta


def parse(*argv):
    return cli.add_common_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_write_metadata(tmp_path):
    args = parse("--method", "restkv", "--alpha", "0.4")
    path = meta.write_metadata(str(tmp_path), args, {"benchmark": "x"})
    written = json.loads(open(path).read())
    assert written["config"]["alpha"] == 0.4 and written["benchmark"] == "x"
    assert set(written["versions"]) >= {"torch", "transformers", "restkv"} and written["versions"]["restkv"]
    assert "git_sha" in written


def test_write_metadata_refuses_a_label_whose_knobs_changed(tmp_path):
    configs = grid.method_configs(parse("--method", "restkv", "snapkv"))
    meta.write_metadata(str(tmp_path), parse(), {"configs": grid.configs_meta(configs)})
    meta.write_metadata(str(tmp_path), parse(), {"configs": grid.configs_meta(configs[1:])})  # same knobs
    written = json.loads((tmp_path / "run_meta.json").read_text())
    assert set(written["configs"]) == {"restkv_128", "snapkv_128"}  # the earlier label stays on record
    # the same label resolving to other knobs (as after a default changed) must not resume into old records
    changed = [("restkv_128", {"method": "restkv", "max_capacity_prompt": 128, "kernel_size": 5})]
    current = grid.configs_meta(changed)
    with pytest.raises(ValueError, match=r"run_meta.json: results for restkv_128 .*kernel_size=7 then, 5 now"):
        meta.write_metadata(str(tmp_path), parse(), {"configs": current})
