"""A packaged GGUF model converted once to a float32 safetensors checkpoint (with its tokenizer)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..lazy import torch
from .files import new_file_mode


def atomic_dir(out_dir, write):
    """Fill a temporary folder beside ``out_dir`` with ``write(tmp)``, then rename it to ``out_dir``.

    If ``write`` fails the temporary folder is removed and ``out_dir`` is left as it was.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp"))
    try:
        write(tmp)
        for folder, _, files in os.walk(tmp):  # mkdtemp (and some writers) create 0700 / 0600
            os.chmod(folder, new_file_mode(folder=True))
            for name in files:
                os.chmod(os.path.join(folder, name), new_file_mode())
        if out_dir.exists():
            shutil.rmtree(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out_dir.is_dir():  # else another process renamed its folder in first
            raise
    return out_dir


def convert_gguf(gguf_file, out_dir):
    """Dequantize ``gguf_file`` into a safetensors checkpoint (with tokenizer) at ``out_dir``.

    The checkpoint is written to a temporary folder beside ``out_dir`` and
    renamed into place, so an interrupted conversion leaves no partial cache.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    src = gguf_file.parent
    fname = gguf_file.name
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    state = quantized.state_dict()
    del quantized
    config = AutoConfig.from_pretrained(src, gguf_file=fname)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(model, "_tied_weights_keys", None) or {}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"{gguf_file}: weights do not match the config (missing {missing}, unexpected {unexpected})"
        )
    model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)

    def write(tmp):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    atomic_dir(out_dir, write)
    return out_dir
