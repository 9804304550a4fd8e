"""The math of the rollout-layout mode (the strategy: ``numerics/rollout_layout.py``): training
reproduces an unmodified rollout engine running at TP=R, whatever its own layout.

- ``engine_math``: what the engine computes (its R row-parallel partials and all-reduce, one
  full-vocab fp32 log-softmax);
- ``linear``: the training side (input gathered along K, weights re-laid by output columns, the
  vocab exchanged in token chunks);
- ``relayout``: the re-laid weight cache, invalidated after every optimizer step.
"""
