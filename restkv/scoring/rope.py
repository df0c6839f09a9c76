"""The rotary position embedding (RoPE) of an attention layer, as scorers that reason about positions need it.

Observations hold the queries and keys after RoPE. A ``Rope`` carries what undoes and redoes the rotation:
the cos/sin the layer applied to the prompt (its forward's ``position_embeddings``), the position of each
sample's next token, and a function that computes cos/sin of other positions with the model's own rotary
module (its RoPE scaling included). Shapes: ``cos``, ``sin`` [b, L, d], the halves of ``d`` rotated
together as transformers' ``rotate_half`` pairs them (``x_i`` with ``x_{i + d/2}``).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Callable

from ..lazy import torch


def rotate_half(x: "torch.Tensor") -> "torch.Tensor":
    """``[x1, x2] -> [-x2, x1]`` over the last axis (the pairing of transformers' RoPE)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """``R x = cos * x + sin * rotate_half(x)``: RoPE with ``cos``, ``sin`` broadcast to ``x``."""
    return x * cos + rotate_half(x) * sin


def rotate_back(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """``R^T x = cos * x - sin * rotate_half(x)`` (the transpose of ``rotate``'s matrix)."""
    return x * cos - rotate_half(x) * sin


@dataclass
class Rope:
    """One layer's RoPE over a prompt.

    cos, sin : [b, L, d] as the layer applied them (in the model's dtype)
    next_position : [b] long, the position of each sample's next token
    embed : ``positions [b, n] -> (cos, sin) [b, n, d]`` float32, the model's rotary module
    """

    cos: "torch.Tensor"
    sin: "torch.Tensor"
    next_position: "torch.Tensor"
    embed: Callable

    @classmethod
    def of(cls, embed: Callable, position_ids: "torch.Tensor") -> "Rope":
        """The RoPE of a prompt at ``position_ids`` [b, L] (cos/sin from ``embed``)."""
        cos, sin = embed(position_ids)
        return cls(cos, sin, position_ids[:, -1] + 1, embed)

    def part(self, sample, start: int) -> "Rope":
        """The RoPE of samples ``sample`` (a slice) from prompt position index ``start`` on."""
        return Rope(
            self.cos[sample, start:],
            self.sin[sample, start:],
            self.next_position[sample],
            self.embed,
        )

    def unrotate(self, x: "torch.Tensor", start: int, stop: int) -> "torch.Tensor":
        """x [b, H, stop - start, d] after RoPE at prompt indices ``start:stop`` -> before RoPE, float32.

        Divides by ``cos^2 + sin^2``, so a RoPE whose cos/sin carry an attention scaling is undone exactly.
        """
        cos = self.cos[:, None, start:stop].float()
        sin = self.sin[:, None, start:stop].float()
        out = x.to(torch.float32, copy=True)
        turned = rotate_half(out).mul_(sin)
        return out.mul_(cos).sub_(turned).div_(cos.square() + sin.square())

    def mean_future(self, n: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(cos, sin) [b, d] averaged over each sample's next ``n`` positions: the averaged rotation
        ``mean_p R_p = diag(cos) + diag(sin) rotate_half``."""
        positions = self.next_position[:, None] + torch.arange(n, device=self.next_position.device)
        cos, sin = self.embed(positions)
        return cos.float().mean(1), sin.float().mean(1)


class LazyRope(Rope):
    """A ``Rope`` made the first time a scorer reads it (``make() -> Rope``): no kernel runs for a
    scorer that never reads RoPE."""

    def __init__(self, make: Callable[[], Rope], embed: Callable):
        self._make = make
        self._made = None
        self.embed = embed

    def _rope(self) -> Rope:
        if self._made is None:
            self._made = self._make()
        return self._made

    @property
    def cos(self) -> "torch.Tensor":
        return self._rope().cos

    @property
    def sin(self) -> "torch.Tensor":
        return self._rope().sin

    @property
    def next_position(self) -> "torch.Tensor":
        return self._rope().next_position


def rotary_module(model, attention) -> "torch.nn.Module | None":
    """The rotary embedding module that serves ``attention``: its own ``rotary_emb``, else that of the
    innermost module of ``model`` holding both a ``rotary_emb`` and the attention module."""
    own = getattr(attention, "rotary_emb", None)
    if isinstance(own, torch.nn.Module):
        return own
    found = None
    for m in model.modules():
        rotary = getattr(m, "rotary_emb", None)
        if isinstance(rotary, torch.nn.Module) and any(sub is attention for sub in m.modules()):
            found = rotary  # modules() goes outside in: the last match is the innermost
    return found


def rotary_function(rotary, attention=None) -> Callable:
    """``positions [b, n] -> (cos, sin) [b, n, d]`` float32 from a transformers rotary module.

    The layer type of ``attention`` (Gemma 3's global and local RoPE) is passed when the module takes one.
    Each call runs the module's class ``forward`` on a copy with its own buffers: a dynamic RoPE updates its
    frequencies for the largest position it sees, and that update stays out of the model (no hooks run).
    """
    forward = type(rotary).forward
    layer_type = getattr(attention, "layer_type", None)
    extra = (
        {"layer_type": layer_type}
        if layer_type and "layer_type" in inspect.signature(forward).parameters
        else {}
    )

    def embed(positions):
        clone = copy.copy(rotary)
        clone._buffers = {
            name: b if b is None else b.clone() for name, b in rotary._buffers.items()
        }
        with torch.no_grad():
            cos, sin = forward(clone, torch.empty(0, device=positions.device), positions, **extra)
        return cos.float(), sin.float()

    return embed


def capture(embed: Callable | None, kwargs: dict, batch: int) -> Rope | None:
    """The ``Rope`` of an attention forward from its keyword arguments (None without ``position_embeddings``)."""
    pe = kwargs.get("position_embeddings")
    if pe is None or embed is None:
        return None
    cos, sin = pe
    ids = kwargs.get("position_ids")
    if ids is None:
        ids = torch.arange(cos.shape[-2], device=cos.device)[None]
    return Rope(
        cos.expand(batch, -1, -1), sin.expand(batch, -1, -1), ids[:, -1].expand(batch) + 1, embed
    )
