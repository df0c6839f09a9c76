"""Shared machinery of the benchmark runners.

Command-line flags (with the original ReST-KV names), the method x budget grid
(validated, with labels that name non-default knobs), resumable JSONL results,
prompt building, batched greedy generation (one config, or several on one
prefill) and run metadata.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Knobs forwarded to ``restkv.configure`` only when given on the command line.
KNOBS = ("preset", "window_size", "kernel_size", "pooling", "use_wo", "use_norm", "use_ema", "alpha",
         "metric_mode", "scale", "tau", "use_pyramid", "beta", "merge", "gqa_agg", "sink_tokens",
         "head_budget", "floor", "normalize", "head_importance", "headkv_beta", "varlen",
         "quant_method", "nbits", "residual_length", "q_group_size")
QUANT_FIELDS = ("quant_method", "nbits", "residual_length", "q_group_size")


def str2bool(text):
    """Parse ``1/0/true/false/yes/no`` (any case) into a bool for argparse."""
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "y", "on"):
        return True
    if value in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (1/0/true/false), got {text!r}")


def add_common_args(parser):
    """Add the flags every runner shares to ``parser`` and return it.

    Eviction knobs default to ``None`` and are then not forwarded, so the
    core's own defaults apply.
    """
    g = parser.add_argument_group("model and methods")
    g.add_argument("--method", nargs="+", default=None,
                   help="one or more methods (space or comma separated), e.g. restkv snapkv fullkv "
                        "(default: restkv, the needle runner restkv snapkv fullkv; none when only --variant is given)")
    g.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "KNOBS"),
                   help="an extra config per budget labelled NAME_<budget>, with KNOBS (knob=value,... over the "
                        "command line's knobs; method restkv unless given), e.g. restkv_paper preset=paper (repeatable)")
    g.add_argument("--model_path", default="smollm2-135m",
                   help="registry name (smollm2-135m, gemma3-270m), local path or hub id")
    g.add_argument("--max_capacity_prompts", nargs="+", type=int, default=[128],
                   help="KV budgets per head and layer; one run per budget")
    g.add_argument("--attn_implementation", default="sdpa")
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    g.add_argument("--device", default="cpu")
    g.add_argument("--batch_size", type=int, default=1)
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--save_dir", default="results")
    g.add_argument("--chat_template", default="auto", choices=("auto", "on", "off"),
                   help="apply the model's chat template (auto: when it has one)")
    g.add_argument("--max_length", type=int, default=None,
                   help="prompt length cap in tokens (default: the model's max context)")
    g.add_argument("--no_sweep", action="store_true",
                   help="one prefill per config (configure + generate) instead of one shared prefill")
    g.add_argument("--device_map", default=None,
                   help="load with this device map (e.g. auto: layers spread over the GPUs, then CPU/disk)")
    g.add_argument("--offload_folder", default=None, help="folder of disk-offloaded weights (--device_map)")
    k = parser.add_argument_group("eviction knobs (unset: the core's defaults)")
    k.add_argument("--window_size", type=int)
    k.add_argument("--kernel_size", type=int)
    k.add_argument("--pooling", choices=("avgpool", "maxpool", "adaptive", "none"))
    k.add_argument("--use_wo", type=str2bool)
    k.add_argument("--use_norm", type=str2bool)
    k.add_argument("--use_ema", type=str2bool)
    k.add_argument("--alpha", type=float)
    k.add_argument("--metric_mode", choices=("before", "after"))
    k.add_argument("--scale", type=float)
    k.add_argument("--tau", type=float)
    k.add_argument("--use_pyramid", type=str2bool)
    k.add_argument("--beta", type=float)
    k.add_argument("--merge", choices=("none", "pivot"))
    k.add_argument("--gqa_agg", choices=("mean", "max", "sum_norm", "rank"))
    k.add_argument("--sink_tokens", type=int)
    k.add_argument("--preset", choices=("paper",), help="named knob set; explicit knobs override it")
    h = parser.add_argument_group("per-head budgets (unset: the core's defaults)")
    h.add_argument("--head_budget", choices=("uniform", "adakv", "headkv"))
    h.add_argument("--floor", type=float, help="AdaKV: least share of the per-head budget")
    h.add_argument("--normalize", type=str2bool, help="AdaKV: weight heads by their top-B mass")
    h.add_argument("--head_importance", help="HeadKV: JSON file of per-layer, per-head scores")
    h.add_argument("--headkv_beta", type=float)
    h.add_argument("--varlen", type=str2bool, help="pack per-head budgets (false: padded, masked layout)")
    q = parser.add_argument_group("KV quantization of the kept entries (unset: full precision)")
    q.add_argument("--quant_method", choices=("quanto", "hqq"))
    q.add_argument("--nbits", type=int)
    q.add_argument("--residual_length", type=int)
    q.add_argument("--q_group_size", type=int)
    return parser


def parse_methods(values):
    """Flatten ``["restkv,snapkv", "fullkv"]`` into ``["restkv", "snapkv", "fullkv"]`` (order kept, no repeats)."""
    out = []
    for value in values:
        for name in str(value).split(","):
            name = name.strip().lower()
            if name and name not in out:
                out.append(name)
    return out


def method_configs(args):
    """Every method x budget of ``args``, then every ``--variant`` x budget, as ``(label, configure_kwargs)``,
    each validated.

    Labels are ``<method>_<budget>``, followed by ``-<knob>=<value>`` for every knob whose
    resolved value differs from that of ``method`` and ``budget`` alone (sorted by name), so
    runs with different knobs never share a label. ``fullkv`` appears once, labelled ``fullkv``,
    with no budget and no knobs. Only the knobs given on the command line are in the kwargs.
    A variant ``NAME KNOBS`` is labelled ``NAME_<budget>``; its knobs override the command line's.
    Without ``--method`` the methods are ``args.default_methods`` (if set, else ``restkv``), or none when
    there are variants.

    Raises
    ------
    ValueError
        For a method that ``restkv.METHODS`` does not know, a budget < 1, a variant name that is not a
        plain file name or repeats a label, or a config that ``restkv.CompressionConfig.from_kwargs``
        rejects (the message names the label and the field).
    """
    import restkv

    variants = getattr(args, "variant", None) or []
    default = [] if variants else getattr(args, "default_methods", ["restkv"])
    methods = parse_methods(args.method if args.method is not None else default)
    unknown = [m for m in methods if m not in restkv.METHODS]
    if unknown:
        raise ValueError(f"method: unknown {unknown}; choose from {list(restkv.METHODS)}")
    budgets = list(dict.fromkeys(int(b) for b in args.max_capacity_prompts))
    if any(b < 1 for b in budgets):
        raise ValueError(f"max_capacity_prompts: budgets must be >= 1, got {budgets}")
    knobs = {k: getattr(args, k) for k in KNOBS if getattr(args, k, None) is not None}
    grid = [(m, {"method": m}, None) for m in methods]
    for name, text in variants:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.=+-]*", name):
            raise ValueError(f"variant {name!r}: the name must be a plain file name (letters, digits, _ . = + -)")
        try:
            grid.append((name, {"method": "restkv", **parse_knobs(text)}, name))
        except ValueError as err:
            raise ValueError(f"variant {name}: {err}") from None
    configs = []
    for stem, own, variant in grid:
        if own["method"] == "fullkv" and variant is None:
            configs.append(("fullkv", {"method": "fullkv"}))
            continue
        for budget in budgets:
            kwargs = {"max_capacity_prompt": budget, **knobs, **own}
            label = f"{stem}_{budget}"
            try:
                diff = knob_diff(kwargs)
            except ValueError as err:
                raise ValueError(f"variant {variant}: {label}: {err}" if variant else f"{label}: {err}") from None
            if variant is None:
                label += "".join(f"-{k}={_short(k, v)}" for k, v in diff.items())
            configs.append((label, kwargs))
    labels = [label for label, _ in configs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"variant: labels {repeated} repeat; give each variant its own name")
    return configs


def parse_knobs(text):
    """``"gqa_agg=sum_norm,use_ema=0"`` -> ``{"gqa_agg": "sum_norm", "use_ema": False}`` (types from the
    config's defaults; ``method`` and ``preset`` allowed too).

    Raises
    ------
    ValueError
        For an item that is not ``knob=value`` with a known knob, or a value of the wrong type.
    """
    import dataclasses

    from restkv import CompressionConfig

    defaults = {f.name: f.default for f in dataclasses.fields(CompressionConfig)}
    defaults.update(method="", preset="")
    knobs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in defaults or name == "max_capacity_prompt":
            raise ValueError(f"knob {item!r}: expected knob=value with a knob of CompressionConfig, method or preset")
        kind = type(defaults[name])
        try:
            knobs[name] = (str2bool(value) if kind is bool else kind(value) if kind in (int, float)
                           else None if value.lower() == "none" and defaults[name] is None else value)
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise ValueError(f"knob {item!r}: {err}") from None
    return knobs


def knob_diff(kwargs):
    """Validate ``kwargs`` and return the resolved knobs that differ from its method and budget alone.

    Raises
    ------
    ValueError
        ``restkv.CompressionConfig.from_kwargs``'s error, naming the field.
    """
    import dataclasses

    from restkv import CompressionConfig

    cfg = resolved_knobs(kwargs)
    # the method's own defaults (pooling, head_budget), with a budget and table any default accepts
    ref = dataclasses.asdict(CompressionConfig(method=cfg["method"], max_capacity_prompt=2**62, head_importance="-"))
    ref.update(max_capacity_prompt=cfg["max_capacity_prompt"], head_importance=None)
    return {k: v for k, v in sorted(cfg.items()) if v != ref[k]}


def _short(knob, value):
    """``value`` as it appears in a label (a head-importance file by its name)."""
    return os.path.splitext(os.path.basename(value))[0] if knob == "head_importance" else value


def quant_settings(kwargs):
    """The KV quantization of a config: ``None`` (full precision) or a dict of ``QUANT_FIELDS``."""
    from restkv import CompressionConfig

    cfg = CompressionConfig.from_kwargs(**kwargs)
    return {k: getattr(cfg, k) for k in QUANT_FIELDS} if cfg.quant_method else None


def configs_meta(configs):
    """Run metadata of ``method_configs``: per label its kwargs, non-default knobs, quantization and every
    knob's resolved value (what a rerun into the same folder must match)."""
    return {label: {"configure": kw, "knobs": knob_diff(kw), "quant": quant_settings(kw),
                    "resolved": resolved_knobs(kw)} for label, kw in configs}


def resolved_knobs(kwargs):
    """Every knob of ``kwargs`` as ``CompressionConfig`` resolves it (defaults filled in, validated)."""
    import dataclasses

    from restkv import CompressionConfig

    return dataclasses.asdict(CompressionConfig.from_kwargs(**kwargs))


def check_same_configs(path, previous, current):
    """Raise if a label of ``current`` (``configs_meta``) resolved to other knobs in ``previous`` (same folder):
    its records would mix two configs (e.g. after a default changed)."""
    for label, meta in current.items():
        old = (previous.get(label) or {}).get("resolved")
        if old is None:
            continue
        changed = {k: (old.get(k), v) for k, v in meta["resolved"].items() if old.get(k) != v}
        if changed:
            what = ", ".join(f"{k}={a!r} then, {b!r} now" for k, (a, b) in sorted(changed.items()))
            raise ValueError(f"{path}: results for {label} were made with other knobs ({what}); "
                             "rerunning into this folder would mix them: use another --save_dir")


def load_from_args(args, shard=None):
    """Seed, then load ``args.model_path`` with the dtype/device/backend flags.

    Under a multi-process launch ``--device cuda`` means this process's own GPU. With
    ``--device_map`` the model is spread by accelerate (``--offload_folder`` for disk offload).

    Returns
    -------
    (model, tokenizer, max_length)
        ``max_length`` is ``args.max_length`` or the model's max context.
    """
    from restkv.models import load_model, max_context

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
                                  dtype=DTYPES[args.dtype], device=device, **kwargs)
    return model, tokenizer, args.max_length or max_context(model)


def model_name(model_path):
    """Folder name of a model: the registry name or the last part of its path."""
    return os.path.basename(os.path.normpath(str(model_path)))


def _key(fields, record_or_key):
    if isinstance(record_or_key, dict):
        missing = [f for f in fields if f not in record_or_key]
        if missing:
            raise KeyError(f"record lacks key fields {missing}")
        values = [record_or_key[f] for f in fields]
    else:
        values = list(record_or_key) if isinstance(record_or_key, (tuple, list)) else [record_or_key]
        if len(values) != len(fields):
            raise ValueError(f"key {record_or_key!r} does not match key fields {list(fields)}")
    return json.dumps(values)


class JsonlWriter:
    """Append-only JSONL results file that resumes where a previous run stopped.

    On open, the keys of the records already in ``path`` are loaded. Every
    record ends with a newline, so bytes after the last newline are a write cut
    short by a kill: they are dropped from the file and that record is computed
    and written again. A malformed complete line raises.

    Parameters
    ----------
    path : str
        Results file (created with its folder when missing).
    key_fields : sequence of str
        Record fields that identify one unit of work.
    """

    def __init__(self, path, key_fields):
        self.path = str(path)
        self.key_fields = tuple(key_fields)
        self.keys = set()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.exists(self.path):
            self._load()
        self._fh = open(self.path, "a", encoding="utf-8")

    def _load(self):
        with open(self.path, "rb") as fh:
            data = fh.read()
        *lines, tail = data.split(b"\n")  # ``tail``: bytes after the last newline
        for lineno, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
                self.keys.add(_key(self.key_fields, record))
            except (ValueError, KeyError) as err:
                raise ValueError(f"{self.path}:{lineno}: malformed record ({err})") from None
        if tail:  # a write cut short: drop it, the record is recomputed
            with open(self.path, "r+b") as fh:
                fh.truncate(len(data) - len(tail))

    def done(self, record_or_key):
        """Whether a record with this key (a record dict or a tuple of key values) is already written."""
        return _key(self.key_fields, record_or_key) in self.keys

    def write(self, record):
        """Append ``record`` as one line, flushed and fsynced.

        Raises
        ------
        ValueError
            If a record with the same key was already written.
        """
        key = _key(self.key_fields, record)
        if key in self.keys:
            raise ValueError(f"{self.path}: duplicate record for key {key}")
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.keys.add(key)

    def __len__(self):
        return len(self.keys)

    def close(self):
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_jsonl(path):
    """Yield the records of a JSONL file (blank lines skipped).

    Raises
    ------
    ValueError
        ``path:line`` of the first line that is not a JSON object.
    """
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            yield record


def read_records(path, fields):
    """Records of a JSONL data file, each checked to carry ``fields`` (ValueError naming the record)."""
    records = []
    for i, record in enumerate(read_jsonl(path)):
        missing = [f for f in fields if f not in record]
        if missing:
            raise ValueError(f"{path}: record {i + 1} lacks fields {missing}")
        records.append(record)
    return records


def middle_truncate(ids, max_len):
    """Keep the first ``ceil(max_len/2)`` and last ``floor(max_len/2)`` items of ``ids`` if longer than ``max_len``."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if len(ids) <= max_len:
        return ids
    head = (max_len + 1) // 2
    tail = max_len - head
    if tail == 0:
        return ids[:head]
    if isinstance(ids, torch.Tensor):
        return torch.cat([ids[:head], ids[-tail:]])
    return ids[:head] + ids[-tail:]


def has_chat_template(tokenizer):
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt(tokenizer, text, chat_template="auto"):
    """Wrap ``text`` as one user turn in the model's chat template.

    Parameters
    ----------
    chat_template : {"auto", "on", "off"} or bool
        ``auto`` applies the template when the tokenizer has one; ``on``
        requires one; ``off`` returns ``text`` unchanged.
    """
    mode = {True: "on", False: "off"}.get(chat_template, chat_template)
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"chat_template must be auto/on/off, got {chat_template!r}")
    if mode == "off" or (mode == "auto" and not has_chat_template(tokenizer)):
        return text
    if not has_chat_template(tokenizer):
        raise ValueError("chat_template: 'on' but the tokenizer has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def encode(tokenizer, text, offsets=False):
    """Token ids of ``text``; the tokenizer's special tokens are added unless the text already starts with BOS.

    With ``offsets=True`` returns ``(ids, [(char_start, char_end), ...])``.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and text.startswith(bos))
    enc = tokenizer(text, add_special_tokens=add, return_offsets_mapping=offsets)
    return (enc.input_ids, [tuple(o) for o in enc.offset_mapping]) if offsets else enc.input_ids


def left_pad(tokenizer, prompts, device):
    """Encode and left-pad a batch of prompts.

    Parameters
    ----------
    prompts : list of str or list of list of int
        Texts (encoded with :func:`encode`) or token ids.

    Returns
    -------
    (input_ids, attention_mask, pad_token_id)
    """
    ids = [encode(tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=torch.long)
    return input_ids.to(device), mask.to(device), pad


def input_device(model):
    """Device of the model's input embeddings (the first device of a ``device_map`` model; CPU when offloaded)."""
    device = model.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts, max_new_tokens):
    """Greedy-decode a batch of prompts, left padded, with the model's current eviction config.

    Parameters
    ----------
    prompts : list of str or list of list of int
        Texts (encoded with :func:`encode`) or token ids.

    Returns
    -------
    list of str
        The generated continuation of each prompt only, special tokens removed.
    """
    input_ids, mask, pad = left_pad(tokenizer, prompts, input_device(model))
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
    return tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)


@torch.inference_mode()
def sweep_batch(model, tokenizer, prompts, configs, max_new_tokens):
    """Greedy-decode a batch of prompts under several eviction configs with one prefill (``restkv.sweep``).

    Decoding is that of :func:`generate_batch` (left padding, the model's EOS, special tokens removed).

    Parameters
    ----------
    configs : list of dict
        ``restkv.configure`` kwargs, one per config.

    Returns
    -------
    list of (list of str, list)
        Per config: the continuations and the per-layer kept positions (as ``restkv.kept_positions``).
    """
    import restkv

    input_ids, mask, pad = left_pad(tokenizer, prompts, input_device(model))
    results = restkv.sweep(model, input_ids, mask, configs, max_new_tokens, pad_token_id=pad)
    return [(tokenizer.batch_decode(tokens, skip_special_tokens=True), kept) for tokens, kept in results]


def decode_configs(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
    """Continuations and kept positions of a batch under each config.

    With ``sweep`` one prefill serves every config (:func:`sweep_batch`); without it each config
    is set with ``restkv.configure`` and decoded by :func:`generate_batch` (the reference path).
    Both give the same result.

    Returns
    -------
    list of (list of str, list)
        Per config: the continuations and the per-layer kept positions.
    """
    import restkv

    if sweep:
        return sweep_batch(model, tokenizer, prompts, configs, max_new_tokens)
    out = []
    for kwargs in configs:
        restkv.configure(model, **kwargs)
        out.append((generate_batch(model, tokenizer, prompts, max_new_tokens), restkv.kept_positions(model)))
    return out


def _version(dist, module=None):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(module or dist), "__version__", None)


def git_sha(path=None):
    """HEAD commit of the repository holding ``path`` (default: this package), or None."""
    where = path or os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def write_metadata(save_dir, args, extra=None):
    """Write ``save_dir/run_meta.json``: versions, full config, git sha, command line, ``extra``.

    When ``extra`` has ``configs`` (``configs_meta``) and the folder already holds a run, every label both
    runs share must resolve to the same knobs (else ValueError, before any work); the earlier labels
    stay listed.

    Returns the path written.
    """
    import transformers

    import restkv  # noqa: F401  (so its version is found when not installed as a distribution)

    config = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    path = os.path.join(save_dir, "run_meta.json")
    extra = dict(extra or {})
    if "configs" in extra and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            previous = json.load(fh).get("configs") or {}
        check_same_configs(path, previous, extra["configs"])
        extra["configs"] = {**previous, **extra["configs"]}  # labels of earlier runs stay on record
    meta = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "restkv": _version("restkv")},
        "git_sha": git_sha(),
        "platform": platform.platform(),
        "config": config,
        **extra,
    }
    os.makedirs(save_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=save_dir, prefix=".run_meta.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2, default=str)
    os.replace(tmp, path)
    return path
