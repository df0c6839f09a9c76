"""Where eviction meets a model: attaching it (``attach``: ``configure``, ``compressing``; the mechanism in
``attachment``), sweep mode, compressed contexts, greedy decoding over a given cache, HeadKV's
calibration and loading the packaged models."""
