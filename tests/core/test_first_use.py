"""What a first use of ``configure()`` and friends gets wrong, refused in one line naming it: NumPy and 0-d tensor
numbers taken as numbers, a misspelt knob with its nearest names, an unsupported family by name, a folder that is
no checkpoint, questions of another batch than a compressed context's, a name or a tokenizer in place of the
model; a script saved beside the clone."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import restkv
from restkv.config import CompressionConfig
from helpers import CACHE, ROOT, prompt, tiny_model


def test_numpy_scalars_and_0d_tensors_are_numbers():
    for budget in (np.int64(64), np.int32(64), torch.tensor(64)):
        cfg = CompressionConfig.from_kwargs(method="snapkv", max_capacity_prompt=budget)
        assert cfg.max_capacity_prompt == 64 and type(cfg.max_capacity_prompt) is int
    cfg = CompressionConfig.from_kwargs(method="restkv", temporal="ema", alpha=np.float32(0.5))
    assert cfg.alpha == 0.5 and type(cfg.alpha) is float
    with pytest.raises(ValueError, match="max_capacity_prompt must be an int"):
        CompressionConfig.from_kwargs(max_capacity_prompt=torch.tensor([64]))
    with pytest.raises(ValueError, match="max_capacity_prompt must be an int"):
        CompressionConfig.from_kwargs(max_capacity_prompt=np.float64(64.5))


def test_a_misspelt_knob_names_the_nearest_ones_in_a_short_line():
    with pytest.raises(ValueError) as err:
        CompressionConfig.from_kwargs(max_capacity_prompts=64)
    text = str(err.value)
    assert text.startswith("unknown knob max_capacity_prompts; did you mean max_capacity_prompt")
    assert len(text) < 200 and "restkv.knob_table()" in text
    with pytest.raises(ValueError, match=r"^unknown knob window_sise; did you mean window_size\?"):
        CompressionConfig.from_kwargs(window_sise=8)
    with pytest.raises(ValueError, match=r"^unknown knob qqq \(restkv.knob_table"):
        CompressionConfig.from_kwargs(qqq=8)


def test_an_unsupported_family_is_named():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)).eval()
    for call in (lambda: restkv.configure(model, method="snapkv"),
                 lambda: restkv.compressing(model, method="snapkv").__enter__(),
                 lambda: restkv.compress_context(model, torch.ones(1, 8, dtype=torch.long), method="snapkv")):
        with pytest.raises(ValueError, match=r"^GPT2LMHeadModel \(gpt2\) is not a supported family: .*Llama"):
            call()
    assert getattr(model, "_restkv", None) is None


def test_load_of_a_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"the folder holds no config.json"):
        restkv.load(str(tmp_path))


def test_questions_of_another_batch_than_the_compressed_contexts_are_refused():
    model = tiny_model("llama", "sdpa")
    context = torch.cat([prompt(30, seed=1), prompt(30, seed=2)])
    cache = restkv.compress_context(model, context, method="snapkv", max_capacity_prompt=16, window_size=4)
    assert cache.batch == 2
    one = torch.cat([context[:1], prompt(5, seed=3)], 1)
    with pytest.raises(ValueError, match="holds a batch of 2; its questions must come as a batch of 2 too"):
        model.generate(one, **{CACHE(model): cache}, max_new_tokens=3, do_sample=False, pad_token_id=0)
    both = torch.cat([context, prompt(5, batch=2, seed=3)], 1)
    out = model.generate(both, **{CACHE(model): cache}, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 38)


def test_a_script_saved_beside_the_clone_imports_the_package(tmp_path):
    """``git clone`` names the folder ``restkv``; a script beside it finds that folder first on its path."""
    (tmp_path / "restkv").symlink_to(ROOT)
    (tmp_path / "script.py").write_text("import restkv, restkv.integration\n"
                                        "print(restkv.__file__, 'load' in dir(restkv), restkv.integration.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script's folder first, as a user's
    out = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    package = ROOT / "restkv"
    assert out.stdout.split() == [str(package / "__init__.py"), "True", str(package / "integration" / "__init__.py")], (
        out.stderr[-2000:])


def test_a_name_or_a_tokenizer_in_place_of_the_model_is_named_with_load():
    from transformers import AutoTokenizer

    from helpers import tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer())
    for wrong, got in ((tokenizer, f"got a {type(tokenizer).__name__};"), ("smollm2-135m", "got the str 'smollm2-135m';")):
        for call in (lambda: restkv.configure(wrong, method="snapkv"), lambda: restkv.kept_positions(wrong),
                     lambda: restkv.compress_context(wrong, prompt(8), method="snapkv")):
            with pytest.raises(TypeError) as err:
                call()
            text = str(err.value)
            assert text.startswith("model: restkv takes a loaded model (a torch.nn.Module), ") and got in text
            assert "restkv.load(name) loads one: model, tokenizer = restkv.load(" in text and "\n" not in text


def test_the_originals_method_names_are_read_and_a_near_name_is_suggested():
    model = tiny_model("llama", "sdpa")
    for given, method in (("SnapKV", "snapkv"), ("H2O", "h2o"), ("FullKV", "fullkv"), ("full", "fullkv"),
                          ("StreamingLLM", "streamingllm")):
        assert CompressionConfig.from_kwargs(method=given).method == method
    assert restkv.configure(model, method="SnapKV", max_capacity_prompt=16, window_size=4).method == "snapkv"
    for typo, near in (("snap_kv", "snapkv"), ("rest-kv", "restkv"), ("Expected-Attention", "expected_attention")):
        with pytest.raises(ValueError, match=rf"^method: unknown method '{typo}'; did you mean {near}( or \w+)?\?$"):
            CompressionConfig.from_kwargs(method=typo)
    with pytest.raises(ValueError, match=r"^method: unknown method 'qqq'; one of fullkv, restkv, snapkv, "):
        restkv.configure(model, method="qqq")
