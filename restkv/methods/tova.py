"""TOVA: keep the entries the last query attends to most, averaged over every head of the layer.

Paper: "Transformers are Multi-State RNNs" (Oren et al., 2024), https://arxiv.org/abs/2401.06104;
code: https://github.com/schwartz-lab-NLP/TOVA. Every head of a layer keeps the same positions.

The original keeps the top ``cache_size`` of all positions (the last token included) and evicts again
at every decoding step; here the ``window_size`` most recent tokens are always kept and the top
``B - window_size`` of the rest are chosen at prefill (``window_size=1`` is the original's choice at
prefill: the last token always wins its own attention in practice, and nothing else is forced).
"""

from __future__ import annotations

KNOBS = ()


def score(obs, cfg):
    """Attention of the last prompt query over the prefix, mean over all query heads -> [b, 1, P]."""
    return obs.every_head(obs.window_attention[:, :, -1, : obs.prefix_len]).mean(1, keepdim=True)
