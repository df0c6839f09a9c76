"""scripts/study/frontier.py: the Pareto frontier against brute force, a config's cost by hand."""

from __future__ import annotations

import importlib.util
import random

import pytest
from helpers import ROOT

spec = importlib.util.spec_from_file_location(
    "study_frontier", ROOT / "scripts" / "study" / "frontier.py"
)
frontier = importlib.util.module_from_spec(spec)
spec.loader.exec_module(frontier)


def brute_force(points: dict) -> set:
    """Every point that no other point dominates (cost <= and kl <=, not both equal)."""

    def dominates(a, b):
        return a[0] <= b[0] and a[1] <= b[1] and a != b

    return {
        n
        for n, p in points.items()
        if not any(dominates(q, p) for m, q in points.items() if m != n)
    }


def test_pareto_by_hand():
    points = {
        "snapkv": (1.0, 0.13),
        "restkv": (3.5, 0.11),
        "worst": (4.7, 0.14),  # dearer and worse than restkv
        "boundary": (20.0, 0.097),
        "same_cost_worse": (20.0, 0.099),  # same cost as boundary, higher KL
        "defensive_l2": (3.8, 0.072),  # dominates boundary, refine, defensive
        "defensive": (42.0, 0.071),  # lower KL than defensive_l2, dearer: on the frontier
        "refine": (156.0, 0.078),
        "twin": (42.0, 0.071),  # equal to defensive: both stay
        "cheap_bad": (0.5, 1.3),
        "same_kl_dearer": (10.0, 0.072),  # the KL of defensive_l2 at a higher cost
        "restkv_worse": (3.5, 0.115),  # the cost of restkv (on the frontier) with a higher KL
    }
    expected = {"cheap_bad", "snapkv", "restkv", "defensive_l2", "defensive", "twin"}
    assert frontier.pareto(points) == expected
    assert brute_force(points) == expected


@pytest.mark.parametrize("seed", range(40))
def test_pareto_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 25)
    # small integer grids, so that ties in cost, in KL and in both are common
    points = {f"c{i}": (rng.randint(0, 6), rng.randint(0, 6)) for i in range(n)}
    assert frontier.pareto(points) == brute_force(points)


def test_cost_of_a_config_with_passes():
    step = {
        "settings": {},
        "rows": [
            {"name": "snapkv", "spec": "snapkv", "length": 4096, "cpu": 0.1, "peak_x_kv": 1.0},
            {"name": "restkv", "spec": "restkv", "length": 4096, "cpu": 0.3, "peak_x_kv": 4.0},
            {
                "name": "layer_defensivekv",
                "spec": "layer_defensivekv",
                "length": 4096,
                "cpu": 3.0,
                "peak_x_kv": 3.0,
            },
            {"name": "kvzip", "spec": "kvzip", "length": 4096, "cpu": 0.5, "peak_x_kv": 2.0},
            {
                "name": "layer_forward",
                "spec": "layer_forward",
                "length": 4096,
                "cpu": 6.0,
                "peak_x_kv": 9.0,
            },
        ],
    }
    passes = {
        "settings": {},
        "rows": {
            "fullkv": {
                "prefill_cpu": 10.0,
                "pass_cpu": 0.0,
                "pass_scoring_cpu": 0.0,
                "pass_tokens": 0,
            },
            "kvzip": {
                "prefill_cpu": 40.0,
                "pass_cpu": 30.0,
                "pass_scoring_cpu": 12.0,
                "pass_tokens": 2100,
            },
        },
    }
    out = frontier.combine(step, passes)["configs"]
    assert "layer_forward" not in out
    assert out["restkv"]["cost_x"] == pytest.approx(3.0)
    assert out["restkv"]["kind"] == "step"
    assert out["layer_defensivekv"]["cost_x"] == pytest.approx(30.0)
    assert out["layer_defensivekv"]["kind"] == "global"
    # kvzip: its step (5x) + 30 / 10 of a prefill = 3 layer forwards of 60x SnapKV each
    assert out["kvzip"]["cost_x"] == pytest.approx(5.0 + 3.0 * 60.0)
    assert out["kvzip"]["passes_x"] == pytest.approx(3.0 * 60.0)
    # without the passes' scoring: (30 - 12) / 10 = 1.8 layer forwards
    assert out["kvzip"]["low_x"] == pytest.approx(5.0 + 1.8 * 60.0)
    assert out["restkv"]["low_x"] == pytest.approx(3.0)
    assert out["kvzip"]["kind"] == "passes"


def test_named_specs_of_the_cost_run():
    from compress_step import named, parse_method

    name, spec = named("restkv_boundary1=restkv:refine_rounds=1,refine_candidates=boundary")
    assert name == "restkv_boundary1"
    assert parse_method(spec) == {
        "method": "restkv",
        "refine_rounds": 1,
        "refine_candidates": "boundary",
    }
    assert named("restkv:refine_rounds=8") == ("restkv:refine_rounds=8", "restkv:refine_rounds=8")
    assert named("dms_w64=dms:window_size=64") == ("dms_w64", "dms:window_size=64")
    assert named("snap=snapkv") == ("snap", "snapkv")
    for bad in ("=restkv", "restkv_x=:refine_rounds=8"):
        with pytest.raises(ValueError, match="NAME=METHOD"):
            named(bad)
