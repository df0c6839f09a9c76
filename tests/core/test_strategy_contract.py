"""Every strategy module keeps the contract that ``restkv.config`` and the selection rely on."""

from __future__ import annotations

import pytest

from restkv import config
from restkv.knobs import Knob
from restkv.strategies import RANKINGS, STRATEGIES


@pytest.mark.parametrize("module", STRATEGIES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_each_strategy_declares_knobs_that_every_evicting_method_reads(module):
    assert module.KNOBS and all(isinstance(k, Knob) for k in module.KNOBS)
    for method in ("restkv", "snapkv", "h2o"):
        declared = config.declared(method)
        assert all(declared[k.name] == k for k in module.KNOBS), method


@pytest.mark.parametrize("module", RANKINGS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_each_ranking_strategy_has_its_hook_and_is_off_by_default(module):
    assert callable(module.applies) and callable(module.rank)
    assert not module.applies(config.CompressionConfig(method="snapkv"))


def test_a_strategy_check_runs_before_any_work():
    with pytest.raises(ValueError, match="chunk_size and critical"):
        config.CompressionConfig(method="snapkv", chunk_size=4, critical=True)
    with pytest.raises(ValueError, match="decode_interval"):
        config.CompressionConfig(method="snapkv", decode_interval=8, layer_budget="global")
