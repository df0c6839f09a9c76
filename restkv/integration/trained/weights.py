"""What the trained methods' scores read: a model's weights, from the file knob, memory, the disk cache or
trained once."""

from __future__ import annotations

from ...eviction.plans import attention_modules
from ..computed import computed_once
from .extraction import model_shape
from .files import _read, from_file, save, to_file
from .training import train

VERSION = "t1"  # in the cache file names: a change of recipe gets a new name


def recipe_of(method: str, cfg) -> tuple:
    """What the weights trained under ``cfg`` depend on (their cache key)."""
    return (method, cfg.get("kvzap_type"), cfg.tokenizer, cfg.train_windows, cfg.train_length)


def model_weights(model, method: str, cfg) -> list:
    """``model``'s weights of ``method`` under ``cfg``: from its file knob, memory, the disk cache,
    or trained (then written to the disk cache)."""
    knob = f"{method}_file"
    kind = cfg.get("kvzap_type")
    shape = model_shape(model)
    if cfg.get(knob) is not None:
        return from_file(method, _read(cfg[knob], knob), knob, cfg[knob], shape, kind)
    recipe = recipe_of(method, cfg)

    def fresh():
        weights, _, _ = train(
            model, method, kind, cfg.tokenizer, cfg.train_windows, cfg.train_length
        )
        return weights

    def read(path):
        return from_file(method, _read(str(path), "cache"), "cache", str(path), shape, kind)

    def write(weights, path):
        save(to_file(method, weights), path)

    action = (
        f"training its weights once on the essays' KVzip scores (python -m restkv.train {method})"
    )
    return computed_once(
        model, "trained", VERSION, recipe, fresh, method, read=read, write=write, action=action
    )


def kvzap_data(cfg, model) -> dict:
    """``{layer index: KVzap's weights}`` of ``model`` (read as ``obs.data``)."""
    return dict(
        zip((m.layer_idx for m in attention_modules(model)), model_weights(model, "kvzap", cfg))
    )


def fastkvzip_data(cfg, model) -> dict:
    """``{layer index: the Fast KVzip gate's state dict}`` of ``model`` (read as ``obs.data``)."""
    weights = model_weights(model, "fastkvzip", cfg)
    return dict(zip((m.layer_idx for m in attention_modules(model)), weights))
