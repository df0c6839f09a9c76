"""Where eviction meets a model: attaching it (``attach``: ``configure``, ``compressing``; the mechanism in
``attachment``), sweep mode, compressed contexts, greedy decoding over a given cache, HeadKV's
calibration and loading the packaged models."""

# The public calls of ``attach``, which ``restkv`` offers at its top (imported on first use): named here,
# where naming them imports no torch.
ATTACH_CALLS = (
    "configure",
    "compressing",
    "detach",
    "install",
    "kept_positions",
    "replace_gemma",
    "replace_gemma2",
    "replace_gemma3",
    "replace_llama",
    "replace_mistral",
    "replace_qwen2",
)
