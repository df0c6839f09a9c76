"""Finch: keep the entries the question attends to most, each query's attention scaled by its reach.

Paper: "FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models" (Corallo &
Papotti, TACL 2024), https://doi.org/10.1162/tacl_a_00716; code: kvpress ``FinchPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/finch_press.py``).

SnapKV's score with one change (``normalize_scores``): the attention of a window query at position t
(counted from the sample's first real token) is multiplied by t, the reference's count of the
weights it spreads (a query attending to many keys gives each less); then the mean over the window
queries, no pooling, and the mean over a GQA group (``gqa_agg="mean"``, the reference's).

Differences from the reference:

- the window: the reference's is the question, found by a delimiter token the user inserts between
  the context and the question (``update_model_and_tokenizer``) and removed from the input; here it
  is the last ``window_size`` tokens as for every method: give the question's length as
  ``window_size``;
- ``rerotate_keys`` (the reference's default True) re-rotates the kept keys to contiguous positions
  (kvpress ``KeyRerotationPress``): here the strategy ``rerotate_keys="start"`` (any method; off by
  default, so every entry stays at its original position unless asked);
  ``benchmarks/kvpress_compare.py`` compares both settings;
- ``chunk_length`` (the reference's default None: off) is the strategy ``prompt_chunk``;
- per sample with padding (the reference: batch 1); the window is always kept (as the reference).
"""

from __future__ import annotations

from ..knobs import GQA_AGG, Knob

KNOBS = (
    Knob(
        "normalize_scores",
        True,
        "multiply each window query's attention by its position (its "
        "number of non-zero weights, as the reference counts them) before averaging",
    ),
    GQA_AGG,
)


def score(obs, cfg):
    """Window attention, each query's row times its position, averaged over the window
    -> [b, Hq, P]."""
    a = obs.window_attention[..., : obs.prefix_len]  # [b, Hq, w, P]
    if cfg.normalize_scores:
        n = obs.keys.shape[2]
        reach = obs.positions[:, n - obs.window :].clamp_min(0).float()  # [b, w]
        a = a * reach[:, None, :, None]
    return a.mean(-2)
