"""Eviction on a model whose layers accelerate offloads (CPU and disk) equals eviction on the plain model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import restkv
from helpers import tiny_model

DEVICE_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "disk", "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "cpu"}
CONFIGS = [
    dict(method="snapkv", max_capacity_prompt=24, window_size=8),
    dict(method="adakv", max_capacity_prompt=24, window_size=8),
    dict(method="restkv", max_capacity_prompt=24, window_size=8),
    dict(method="criticalkv", max_capacity_prompt=24, window_size=8),  # reads the o_proj weight itself
    dict(method="expected_attention", max_capacity_prompt=24, window_size=8),  # reads the rotary module
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", "sdpa").save_pretrained(folder)
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    offloaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", device_map=DEVICE_MAP,
                                                     offload_folder=str(folder / "offload")).eval()
    assert offloaded.model.layers[1].self_attn.o_proj.weight.device.type == "meta"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (2, 90), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :20], mask[1, :20] = 0, 0
    return plain, offloaded, ids, mask


def _run(model, ids, mask, cfg):
    restkv.configure(model, **cfg)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:], restkv.kept_positions(model)


def _same(a, b):
    assert torch.equal(a[0], b[0])
    assert [k is None for k in a[1]] == [k is None for k in b[1]]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]) if x is not None)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_offloaded_layers_give_the_same_tokens_and_kept_positions(models, cfg):
    plain, offloaded, ids, mask = models
    reference = _run(plain, ids, mask, cfg)
    assert reference[1][1].shape[-1] == 24 or cfg["method"] == "adakv"
    _same(_run(offloaded, ids, mask, cfg), reference)
    (swept,) = restkv.sweep(offloaded, ids, mask, [cfg], 6, pad_token_id=0)
    _same(swept, reference)
