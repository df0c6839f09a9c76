"""What a grid's configs resolve to: the knobs that differ from their method and budget alone, their KV
quantization, every knob's resolved value, and the check that a rerun into the same folder resolves alike.
Imports no torch."""

from restkv.config import CompressionConfig, declared

QUANT_FIELDS = ("quant_method", "nbits", "residual_length", "q_group_size")


def knob_diff(kwargs):
    """Validate ``kwargs`` and return the resolved knobs that differ from its method and budget alone.

    Raises
    ------
    ValueError
        ``restkv.CompressionConfig.from_kwargs``'s error, naming the field.
    """
    return resolved_diff(CompressionConfig.from_kwargs(**kwargs))


def resolved_diff(cfg):
    """The knobs of a resolved config that differ from those of its method and budget alone."""
    knobs = declared(cfg["method"])  # the method's own defaults (pooling, head_budget, ...)
    return {
        k: v
        for k, v in sorted(cfg.items())
        if k not in ("method", "max_capacity_prompt", "max_capacity_prompt_ratio")
        and v != knobs[k].default
    }


def quant_settings(kwargs):
    """The KV quantization of a config: ``None`` (full precision) or a dict of ``QUANT_FIELDS``."""
    return quant_of(CompressionConfig.from_kwargs(**kwargs))


def quant_of(cfg):
    """The KV quantization of a resolved config (None: full precision)."""
    return {k: cfg[k] for k in QUANT_FIELDS} if cfg.get("quant_method") else None


def resolved_knobs(kwargs):
    """Every knob of ``kwargs`` as ``CompressionConfig`` resolves it (defaults filled in, validated)."""
    return CompressionConfig.from_kwargs(**kwargs).as_dict()


def check_same_configs(path, previous, current):
    """Raise if a label of ``current`` (``configs_meta``) resolved to other knobs in ``previous`` (same folder):
    its records would mix two configs (e.g. after a default changed)."""
    for label, meta in current.items():
        old = (previous.get(label) or {}).get("resolved")
        if old is None:
            continue
        changed = {k: (old[k], v) for k, v in meta["resolved"].items() if k in old and old[k] != v}
        if changed:
            what = ", ".join(f"{k}={a!r} then, {b!r} now" for k, (a, b) in sorted(changed.items()))
            raise ValueError(
                f"{path}: results for {label} were made with other knobs ({what}); "
                "rerunning into this folder would mix them: use another --save_dir"
            )
