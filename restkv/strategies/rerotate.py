"""Key re-rotation (``rerotate_keys``): the kept keys re-rotated to contiguous positions.

kvpress's ``KeyRerotationPress`` (``kvpress/presses/key_rerotation_press.py``; the rotation of
transformers' ``SinkCache`` and of FINCH,
https://direct.mit.edu/tacl/article/doi/10.1162/tacl_a_00716/125280): RoPE is undone at each kept
key's position and redone at its index among the kept ones, ``k' = R(j) R(p)^T k``. Values, the kept
set and the reported positions (``restkv.kept_positions``) are unchanged; only the keys move. ``R``
is the layer's own rotary module (its RoPE scaling included).

- ``"start"``: kvpress's. A head keeping c entries holds them at positions 0 .. c - 1 (from the
  sample's first real token); later tokens keep their own positions (generate's ``cache_position``
  and position ids are untouched, as kvpress's pipeline does), so a gap of L - c positions separates
  the kept entries from the next token.
- ``"end"``: the kept entries at the c positions just before the next token, L - c .. L - 1, and
  later tokens at their own positions: every distance from a new token to a kept one is what it
  would be had the cache held exactly those c tokens in a row and positions counted on from c (RoPE
  scores depend only on the distance), so the cache reads as a sequence growing from c, not from L.
  The window keeps its own positions (it already ends at L - 1). With ``decode_interval`` each
  eviction while decoding packs the held entries again before the newest token (the held keys'
  positions follow from the layout: a head's entries are contiguous and end at the newest token);
  ``"start"`` leaves its gap and is refused there.

The rotation is computed in float32 (divided by ``cos^2 + sin^2``, so a RoPE whose cos/sin carry an
attention scaling is undone exactly) and cast back to the keys' dtype. At prefill the RoPE position
of each sample's first real token is read off the layer's RoPE (the prompt's next position minus its
real tokens); while decoding, positions are counted from the first real token, as generate counts
them for left-padded batches (as the decoding scorers' RoPE is).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch
from ..scoring.rope import rotate, rotate_back

MODES = ("none", "start", "end")
KNOBS = (
    Knob(
        "rerotate_keys",
        "none",
        "re-rotate the kept keys to contiguous positions (kvpress's KeyRerotationPress): "
        "start (positions 0..c-1, kvpress's) or end (the c positions before the next token); "
        "none: keep them",
        choices=MODES,
        stage="select",
    ),
)


def check(values: dict) -> None:
    if values.get("rerotate_keys") == "start" and values.get("decode_interval"):
        raise ValueError(
            "rerotate_keys='start' leaves a gap before the decoded tokens that decode_interval "
            "cannot pack again: use rerotate_keys='end' with decode_interval"
        )


def applies(cfg) -> bool:
    return cfg.get("rerotate_keys", "none") != "none"


def packed_positions(valid: "torch.Tensor", last: "torch.Tensor", mode: str) -> "torch.Tensor":
    """[b, H, K] long: each head's valid entries, in order, at contiguous positions.

    valid [b, H, K] bool; ``last`` [b] long, the newest position (``"end"``: the entries end there;
    ``"start"``: they start at 0). Invalid slots get 0.
    """
    rank = valid.long().cumsum(-1) - 1
    if mode == "start":
        return rank.clamp_min(0) * valid
    count = valid.sum(-1, keepdim=True)  # [b, H, 1]
    return (last[:, None, None] - count + 1 + rank).clamp_min(0) * valid


def rerotated(keys, valid, now, target, embed) -> "torch.Tensor":
    """Keys [b, H, K, d] rotated at positions ``now`` [b, H, K] -> rotated at ``target`` [b, H, K].

    ``embed``: positions [b, n] -> (cos, sin) [b, n, d] float32 (the layer's rotary module);
    slots not ``valid`` [b, H, K], and keys that do not move, are left as they are (bit for bit).
    """
    b, heads, k, d = keys.shape
    cos_now, sin_now = (x.view(b, heads, k, d) for x in embed(now.reshape(b, heads * k)))
    cos_new, sin_new = (x.view(b, heads, k, d) for x in embed(target.reshape(b, heads * k)))
    plain = rotate_back(keys.float(), cos_now, sin_now) / (cos_now.square() + sin_now.square())
    moved = rotate(plain, cos_new, sin_new).to(keys.dtype)
    return torch.where((valid & (target != now))[..., None], moved, keys)
