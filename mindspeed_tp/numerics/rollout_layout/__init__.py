"""The rollout-layout mode (profile ``reduction: rollout_layout``): training reproduces an unmodified
rollout engine running at TP=R, whatever its own layout.

- ``strategy``: the strategy (``RolloutLayout``, over the canonical tree; the vLLM engine's subclasses it);
- ``patches``: its patch entries (the weight caches invalidated after a step or a checkpoint load);

- ``engine_math``: what the engine computes (its R row-parallel partials and all-reduce, one
  full-vocab fp32 log-softmax);
- ``linear``: the training side (input gathered along K, weights re-laid by output columns, the
  vocab exchanged in token chunks);
- ``relayout``: the re-laid weight cache, invalidated after every optimizer step.

What ``numerics.MODES`` reads: the strategy class and ``register_patches`` (its patch entries).
"""
from .patches import register as register_patches
from .strategy import RolloutLayout
