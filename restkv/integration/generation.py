"""Greedy decoding over a given cache, as ``generate(do_sample=False)`` does it (sweep mode and compressed
contexts decode with it), and the plans that evict nothing that such decoding reads through."""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import CompressionConfig
from ..compat import cache_argument
from ..eviction.plans import plan_layers


ABSENT = object()  # an argument not given (None means something)


CHECK_EVERY = 32  # decoded tokens between the host reads that end the loop or compact the batch


def greedy_decode(
    model,
    cache,
    first: Tensor,
    position_ids: Tensor,
    mask: Tensor | None,
    steps: int,
    eos: Tensor | None,
    pad: int,
    compact: bool = False,
) -> tuple[Tensor, Tensor]:
    """Greedy decoding as ``generate(do_sample=False)`` does it, from the token chosen at prefill.

    With ``compact``, rows that reached EOS leave the batch (and the cache) once they are half of it.
    Whether every row has finished is read on the host once every ``CHECK_EVERY`` tokens (no host sync per
    token); rows decoded past their EOS give ``pad`` there, as ``generate`` does.
    Returns the tokens [b, <= steps] and, per row, the number of tokens up to its EOS (``steps`` if none).
    """
    b = first.shape[0]
    device = first.device
    tok = first
    pos = position_ids[:, -1:]
    out = torch.full((b, steps), pad, dtype=first.dtype, device=device)
    rows = torch.arange(b, device=device)  # original row of each row still in the batch
    unfinished = torch.ones(b, dtype=torch.bool, device=device)
    length = torch.full((b,), steps, dtype=torch.long, device=device)
    for step in range(steps):
        if step:
            pos = pos + 1
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], -1)
            logits = forward(model, tok[:, None], mask, pos, cache).logits
            tok = logits[:, -1].float().argmax(-1).to(device)
        if eos is not None:
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
            stops = unfinished & torch.isin(tok, eos)
            length[rows] = torch.where(stops, step + 1, length[rows])
            unfinished &= ~stops
        out[rows, step] = tok
        if eos is None or ((step + 1) % CHECK_EVERY and step + 1 < steps):
            continue
        left, longest = torch.stack([unfinished.sum(), length.max()]).tolist()  # one host read
        if not left:
            return out[:, :longest], length
        if compact and 2 * left <= unfinished.numel():
            keep = unfinished.nonzero().squeeze(1)
            for layer in cache.layers:
                layer.reorder_cache(keep)
            tok, pos, rows, unfinished = tok[keep], pos[keep], rows[keep], unfinished[keep]
            mask = None if mask is None else mask[keep]
    return out, length


def positions_and_mask(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """A left-padded attention mask [b, n] (0 on padding) -> the positions [b, n] (0 on padding) and the
    mask the model is given (None when nothing is padded: one host read)."""
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return position_ids, None if bool((mask == 1).all()) else mask


def forward(model, input_ids: Tensor, mask: Tensor | None, position_ids: Tensor, cache=None):
    """The model's output on ``input_ids`` [b, n] with the last position's logits only, appending to
    ``cache`` (None: the model's own new cache)."""
    into = {} if cache is None else {cache_argument(model): cache}
    return model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **into,
    )


def eos_and_pad(model, eos_token_id, pad_token_id, device):
    """The EOS ids [k] (None: never stop) and the pad id of a greedy decode, by default the generation config's."""
    gen = getattr(model, "generation_config", None)
    eos = eos_token_id if eos_token_id is not ABSENT else getattr(gen, "eos_token_id", None)
    if eos is None:
        return None, 0
    eos = torch.as_tensor([eos] if isinstance(eos, int) else list(eos), device=device)
    pad = pad_token_id if pad_token_id is not None else getattr(gen, "pad_token_id", None)
    return eos, int(eos[0]) if pad is None else pad


def full_plans(model):
    """Plans that evict nothing: decoding reads each cache's own layers through them."""
    return plan_layers(model, CompressionConfig(method="fullkv"))
