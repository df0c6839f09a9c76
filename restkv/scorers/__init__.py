"""One file per eviction score. Each ``score(obs, cfg)`` returns float32 [b, Hq or Hkv, P]."""

from . import cam, h2o, l2norm, restkv, snapkv, streamingllm

SCORERS = {
    "restkv": restkv.score,
    "snapkv": snapkv.score,
    "pyramidkv": snapkv.score,
    "h2o": h2o.score,
    "streamingllm": streamingllm.score,
    "cam": cam.score,
    "l2norm": l2norm.score,
    "adakv": snapkv.score,
    "headkv": snapkv.score,
}
