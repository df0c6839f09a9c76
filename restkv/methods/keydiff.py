"""KeyDiff: keep the keys least similar to the layer's mean key direction.

Paper: "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (Park et al., 2025), https://arxiv.org/abs/2504.15364; code: kvpress
``KeyDiffPress`` (https://github.com/NVIDIA/kvpress, ``kvpress/presses/keydiff_press.py``).

Per KV head, the anchor is the mean of the L2-normalised keys of the prompt (its real tokens); an entry's
score is minus the cosine similarity of its key to the anchor. Query-free (no window attention). As the
reference's one-shot press (its block-wise variant is not provided); the observation window is always
kept (the reference keeps none).
"""

from __future__ import annotations

from ..scoring import observe
from ..lazy import F, torch
from ..scoring.observe import weighted_values

KNOBS = ()


def score(obs, cfg):
    """``-cos(k_n, mean_m k_m / ||k_m||)`` per KV head -> [b, Hkv, P] (keys read in float32 blocks)."""
    norms = torch.linalg.vector_norm(obs.keys, dim=-1, dtype=torch.float32).clamp_min_(
        1e-12
    )  # [b, Hkv, L]
    weights = obs.key_valid[:, None].float() / norms  # the mean direction's weights, real keys only
    anchor = F.normalize(
        weighted_values(weights[:, :, None], obs.keys)[:, :, 0], dim=-1, eps=1e-12
    )  # [b, Hkv, d]
    P = obs.prefix_len
    out = torch.empty(norms.shape[0], norms.shape[1], P, device=norms.device)
    for s in range(0, P, observe.VALUE_BLOCK):
        k = obs.keys[:, :, s : min(P, s + observe.VALUE_BLOCK)].float()
        out[..., s : s + k.shape[2]] = (k @ anchor[..., None])[..., 0]
    return out.div_(norms[..., :P]).neg_()
