"""What every scorer reads: the layer's prefill as an ``Observation`` (window attention, W_O factors,
shared quantities), smoothing, RoPE and the exact attention-output error."""
