"""The library without its benchmark layer: with ``restkv.bench`` unimportable, every method configures and
generates, ``restkv.load`` loads the packaged model, and HeadKV without a file computes its own head
scores (``restkv.integration.headkv``) as ``configure`` does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import ROOT

SCRIPT = r'''
import importlib.abc
import json
import sys

sys.path[:0] = [{tests!r}, {root!r}]


class NoBench(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "restkv.bench" or name.startswith("restkv.bench."):
            raise ImportError(f"{{name}} is blocked in this test")
        return None


sys.meta_path.insert(0, NoBench())

import torch

import restkv
from helpers import prompt, small, tiny_model

model = tiny_model("llama", "sdpa")
ids = prompt(90)
layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
table = {{f"{{layer}}-{{head}}": [0.1 * (head + 1) + layer] for layer in range(layers) for head in range(heads)}}
with open({table!r}, "w") as fh:
    json.dump(table, fh)
done = []
for method in restkv.METHODS:
    knobs = small(method, max_capacity_prompt=24, window_size=4)
    if method == "headkv":
        knobs["head_importance"] = {table!r}
    restkv.configure(model, **knobs)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (1, 93), (method, out.shape)
    done.append(method)
restkv.detach(model)
try:
    restkv.configure(model, method="headkv", max_capacity_prompt=24, window_size=4)
except ValueError as error:  # the tiny model has no checkpoint to load a tokenizer from
    assert "head_importance" in str(error) and "checkpoint" in str(error), error
else:
    raise AssertionError("HeadKV without a file on a model without a checkpoint must say so")
from restkv.integration import headkv  # HeadKV's own calibration on the packaged model, as configure runs it

headkv.LENGTHS, headkv.DEPTHS = (384,), (25.0, 75.0)
headkv.table_path = lambda model: __import__("pathlib").Path({calibrated!r})
smol, tokenizer = restkv.load("smollm2-135m")
restkv.configure(smol, method="headkv", max_capacity_prompt=64, window_size=8)
ids = tokenizer("The pass key is 71432. " * 40, return_tensors="pt").input_ids
out = smol.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id)
assert out.shape[1] == ids.shape[1] + 2
assert int((restkv.kept_positions(smol)[0] >= 0).sum(-1).max()) <= 64
with open({calibrated!r}) as fh:
    assert len(json.load(fh)) == 30 * 9
assert not [m for m in sys.modules if m.startswith("restkv.bench")]
print(json.dumps(done))
'''


@pytest.mark.slow
def test_every_method_runs_without_the_benchmark_layer(tmp_path):
    import restkv

    script = SCRIPT.format(tests=str(ROOT / "tests"), root=str(ROOT), table=str(tmp_path / "heads.json"),
                           calibrated=str(tmp_path / "calibrated.json"))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == str(list(restkv.METHODS)).replace("'", '"')
