"""Models of the runners: loading from the command-line flags, and the model's context read without
loading it. Loading itself is the core's (``restkv.integration.models``, re-exported here).
"""

import json
import os
from pathlib import Path

from ..integration.convert import atomic_dir, convert_gguf  # noqa: F401 (re-exported)
from .ggufmeta import gguf_context_length
from ..integration.models import (  # noqa: F401 (the core's loading, re-exported for the runners)
    REGISTRY, cache_dir, essays_dir, essays_text, gguf_path, load_model, model_name, resolve)
from ..lazy import LazyModule, torch

transformers = LazyModule("transformers")


LENGTH_FIELDS = (
    "max_position_embeddings",
    "max_sequence_length",
    "seq_length",
    "n_positions",
    "max_seq_len",
)


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
        raise ValueError(
            f"{type(config).__name__} has no max length field (max_position_embeddings, ...)"
        )
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
        path = gguf_path(name)
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
        found, where = _length_field(hub_config(path)), f"the config of {path}"
    if found is None:
        raise ValueError(
            f"model_path: {where} has no max length field ({', '.join(LENGTH_FIELDS)})"
        )
    return found[1], f"{found[0]} of {where}"


def hub_unreachable(timeout=3.0):
    """Why the model hub cannot be reached (offline mode, or the connection's error), or None.

    One request of ``timeout`` seconds to the hub's endpoint, through huggingface_hub's own session
    (its proxies and endpoint); any HTTP answer counts as reachable.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as err:  # noqa: BLE001 (any transport error: DNS, refused, timeout, proxy)
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"{constants.ENDPOINT}: {reason}"
    return None


def hub_config(repo):
    """The config of hub model ``repo``: from the local hub cache, else fetched from the hub.

    Raises
    ------
    ValueError
        One line naming ``--model_path``: ``repo`` is not cached and the hub cannot be reached
        (checked in seconds, before transformers' own retries), or the hub refused it (unknown,
        gated).
    """
    from huggingface_hub import constants

    try:
        return transformers.AutoConfig.from_pretrained(repo, local_files_only=True)
    except OSError:
        pass
    reason = hub_unreachable()
    if reason is not None:
        raise ValueError(
            f"--model_path {repo}: not in the local hub cache ({constants.HF_HUB_CACHE}) and "
            f"the hub is unreachable ({reason}); give a local folder of the model: "
            f"--model_path /path/to/{model_name(repo)}"
        )
    try:
        return transformers.AutoConfig.from_pretrained(repo)
    except OSError as err:
        raise ValueError(f"--model_path {repo}: {str(err).splitlines()[0]}") from None


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
            raise ValueError(
                f"{flag}: {tokens} tokens{more} exceed the context of {model_name(model_path)}: "
                f"{limit} tokens ({where}){most}"
            )
    return limit


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
    """Set torch's CPU threads (``--threads``, when given) and the seed, then load ``args.model_path`` with the
    dtype/device/backend flags.

    Under a multi-process launch ``--device cuda`` means this process's own GPU. With
    ``--device_map`` the model is spread by accelerate (``--offload_folder`` for disk offload).

    Returns
    -------
    (model, tokenizer, max_length)
        ``max_length`` is ``args.max_length`` or the model's max context.
    """
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
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
    model, tokenizer = load_model(
        args.model_path,
        attn_implementation=args.attn_implementation,
        dtype=args.dtype,
        device=device,
        **kwargs,
    )
    return model, tokenizer, args.max_length or max_context(model)
