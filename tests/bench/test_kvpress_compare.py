"""benchmarks/kvpress_compare.py without kvpress: the pair table, budget matching, kept sets and Jaccard.

The kvpress run itself needs its own venv and is not part of the suite; these are the parts it rests on,
checked against brute force and against kvpress's rules written out here from its source.
"""

from __future__ import annotations

import importlib.util
import random
import sys

import pytest
import torch
from helpers import ROOT

import restkv
from restkv.strategies.budgets import adakv_budgets
from restkv.config import CompressionConfig


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


compare = _load("kvpress_compare")
side = _load("kvpress_side")


def test_ratio_keeps_exactly_the_budget():
    rng = random.Random(0)
    cases = [(2048, 256), (16384, 1024), (2, 1), (4097, 4096)] + [
        (n, rng.randrange(1, n)) for n in (rng.randrange(2, 70000) for _ in range(2000))]
    for length, budget in cases:
        r = compare.compression_ratio(length, budget)
        assert 0 <= r < 1 and max(1, int(length * (1 - r))) == budget, (length, budget, r)


@pytest.mark.parametrize("length, budget", [(100, 0), (100, 100), (100, 150)])
def test_ratio_refuses_budgets_outside_the_prompt(length, budget):
    with pytest.raises(ValueError, match="budget"):
        compare.compression_ratio(length, budget)


def test_jaccard_is_the_set_ratio_per_head():
    g = torch.Generator().manual_seed(0)
    length = 50
    for _ in range(20):
        a = [torch.randperm(length, generator=g)[: int(torch.randint(0, 30, (1,), generator=g))] for _ in range(3)]
        b = [torch.randperm(length, generator=g)[: int(torch.randint(1, 30, (1,), generator=g))] for _ in range(3)]
        pad = lambda rows: torch.stack([torch.cat([r, torch.full((30 - len(r),), -1)]) for r in rows])  # noqa: E731
        got = compare.jaccard(pad(a), pad(b), length)
        want = [len(set(x.tolist()) & set(y.tolist())) / len(set(x.tolist()) | set(y.tolist())) for x, y in zip(a, b)]
        assert got.tolist() == pytest.approx(want)


def test_kept_set_of_a_masking_press_is_the_complement():
    g = torch.Generator().manual_seed(1)
    heads, length = 3, 40
    pruned = torch.randperm(heads * length, generator=g)[:70]
    mask = (torch.zeros(70, dtype=torch.long), pruned // length, pruned % length)
    kept = side.kept_from_mask(mask, heads, length)
    for h in range(heads):
        want = sorted(set(range(length)) - {int(p % length) for p in pruned if p // length == h})
        assert [p for p in kept[h].tolist() if p >= 0] == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_positions_recover_an_unsorted_gather(dtype):
    g = torch.Generator().manual_seed(2)
    full = torch.randn(2, 3, 64, 16, generator=g).to(dtype)
    idx = torch.stack([torch.stack([torch.randperm(64, generator=g)[:20] for _ in range(3)]) for _ in range(2)])
    kept = full.gather(2, idx[..., None].expand(-1, -1, -1, 16))
    assert torch.equal(side.gathered_positions(full, kept), idx)
    changed = kept.clone()
    changed[1, 2, 5, 0] += 1
    assert side.gathered_positions(full, changed) is None  # a press that edits keys has no kept set


@pytest.mark.parametrize("floor, same", [(None, True), (0.2, False)])
def test_adakv_with_kvpress_floor_keeps_what_kvpress_adakv_keeps(floor, same):
    """kvpress AdaKVPress written out from its source: window at max + 1, each head's top int(0.2 B) forced,
    then the layer's bottom Hkv (L - B) pruned. restkv's AdaKV budgets with ``kvpress_floor`` give the same
    sets; with restkv's own floor (0.2 of the prefix budget, as the AdaKV authors') they differ."""
    g = torch.Generator().manual_seed(3)
    hkv, window, length = 4, 64, 600
    agree = []
    for budget in (80, 256, 320, 400, 599):
        scores = torch.rand(1, hkv, length - window, generator=g) ** 4  # skewed, as attention is
        scores[:, 0] *= 1e-3  # a head the layer-wide top-k passes over: only its floor keeps its entries
        full = torch.cat([scores, torch.full((1, hkv, window), float(scores.max()) + 1)], -1)
        n_safe = max(1, int(budget * 0.2))
        forced = full.clone().scatter_(-1, full.topk(n_safe, -1).indices, torch.finfo(torch.float32).max)
        pruned = (-forced.reshape(1, -1)).topk(hkv * (length - budget), -1).indices[0]
        keep = torch.ones(hkv * length, dtype=torch.bool)
        keep[pruned] = False
        want = [set(torch.nonzero(row).flatten().tolist()) for row in keep.view(hkv, length)]

        share = compare.kvpress_floor(budget, window) if floor is None else floor
        sizes = adakv_budgets(scores, budget - window, share, False)[0]
        got = [set(scores[0, h].topk(int(sizes[h])).indices.tolist()) | set(range(length - window, length))
               for h in range(hkv)]
        agree.append(got == want)
    assert all(agree) if same else not all(agree)


def test_pair_table_builds_and_every_registered_row_validates():
    names = [p.name for p in compare.PAIRS]
    assert len(set(names)) == len(names) and names[0] == "SnapKV"  # SnapKV: the reference of the step ratios
    built = []

    class Fake:  # stands for every kvpress class
        def __init__(self, **args):
            built.append(args)

    for p in compare.PAIRS:
        assert p.restkv is not None or p.kvpress is not None
        if p.kvpress is not None:
            classes = side.press_classes(p.kvpress)
            assert classes and all(c.endswith("Press") for c in classes)
            side.build_press(p.kvpress, dict.fromkeys(classes, Fake), 0.75)
            assert compare.RATIO not in compare.describe_press(p.kvpress)
        if p.restkv is not None:
            assert p.restkv["method"] in restkv.METHODS, p.name  # every row is compared, none is kvpress-only
            for budget in (256, 1024):
                cfg = CompressionConfig.from_kwargs(**p.restkv_knobs(budget))
                assert cfg.max_capacity_prompt == p.restkv.get("max_capacity_prompt", budget)  # or UNCAPPED
    assert all(compare.RATIO not in args.values() for args in built)
    assert {"snapkv", "streamingllm", "tova", "adakv", "pyramidkv", "l2norm", "random", "restkv"} <= {
        p.restkv["method"] for p in compare.PAIRS if p.restkv}


def test_missing_kvpress_venv_is_one_line_with_the_install_commands(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(SystemExit) as e:
        compare.main(["--kvpress_python", str(python), "--pairs", "SnapKV"])
    message = str(e.value)
    assert "\n" not in message and f"python3 -m venv {tmp_path / 'venv'}" in message
    assert "pip install torch==2.13.0" in message and "pip install kvpress" in message


@pytest.mark.parametrize("argv, match", [(["--pairs", "Nope"], "--pairs: unknown pair 'Nope'"),
                                         (["--budget", "4096"], "budget must be in"),
                                         (["--samples", "0"], "--samples must be >= 1")])
def test_bad_flags_fail_before_any_work(argv, match):
    with pytest.raises(ValueError, match=match):
        compare.parse_args(argv)


def test_compare_aggregates_over_samples_layers_and_heads():
    length, layers, heads = 10, 3, 2
    same = [torch.arange(4).expand(heads, -1) for _ in range(layers)]
    other = [k.clone() for k in same]
    other[2][1] = torch.tensor([0, 1, 2, 9])  # layer 2, head 1: 3 of 5 in common
    logprobs = torch.randn(5, 7).log_softmax(-1)
    ours = [{"kept": same, "logprobs": logprobs}, {"kept": same, "logprobs": logprobs}]
    theirs = [{"kept": same, "logprobs": logprobs}, {"kept": other, "logprobs": logprobs}]
    row = compare.compare(ours, theirs, [logprobs] * 2, [logprobs] * 2, length)
    assert row["j_min"] == pytest.approx(3 / 5) and row["j_where"] == "L2 h1"
    assert row["j_mean"] == pytest.approx((2 * layers * heads - 1 + 3 / 5) / (2 * layers * heads))
    assert row["kept_r"] == row["kept_k"] == 4 and max(map(abs, row["kl_rk"] + row["kl_r"])) < 1e-6
    assert "kl_k" not in compare.compare(ours, None, [logprobs] * 2, None, length)


def test_equal_presses_run_once():
    specs = [compare.PAIRS[3].kvpress, compare.PAIRS[0].kvpress, compare.PAIRS[4].kvpress]  # AdaKV twice
    unique, keys = compare.distinct(specs)
    assert len(unique) == 2 and keys[0] == keys[2] != keys[1] and unique[keys[1]] == specs[1]


def test_compare_of_a_press_without_kept_sets_still_gives_its_kl():
    """A press that changes the keys in every layer (ThinK's channels) has no kept set: KLs only, no crash."""
    logprobs = torch.randn(5, 7).log_softmax(-1)
    ours = [{"kept": [torch.arange(4).expand(2, -1)], "logprobs": logprobs}]
    theirs = [{"kept": [None], "logprobs": logprobs}]
    row = compare.compare(ours, theirs, [logprobs], [logprobs], 10)
    assert row["kept_k"] is None and "j_mean" not in row and abs(row["kl_rk"][0]) < 1e-6
