"""The canonical-tree mode (profile ``reduction: canonical_tree``, the default).

- ``strategy``: the strategy (``CanonicalTree``): every sum a layout splits folded by one perfect
  binary tree over C leaves; the other modes build on it;
- ``moe_layer``: the MoE layer in one fixed order (also the rollout layout's).

What ``numerics.MODES`` reads: the strategy class (the mode has no patch entries of its own).
"""
from .strategy import CanonicalTree
