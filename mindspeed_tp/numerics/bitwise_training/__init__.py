"""The bitwise-training mode (profile ``bitwise_training: true``): the backward pass and the optimizer
step in canonical order, so every layout gives the same gradients, parameters and optimizer state
after each step (docs/CONTRACT.md, section 9).

- ``strategy``: the strategy (``BitwiseTraining``, a layer over the canonical tree);
- ``patches``: its megatron-core patch entries (DDP, schedules, finalize, clipping, the embedding);

- gradient GEMMs by the invariant kernels (``kernels.linear.InvariantBackward``: a row of dx, an
  element of dW never depends on the shard or on how many rows were computed together);
- ``column_parallel``: column-parallel layers (QKV, fc1, LM head) whose input gradient is a sum over
  the TP-split output features: canonical leaves, folded by moving data (also the SP reduce-scatter);
- ``token_sums``: weight gradients of per-token layers (norms, QK-norms) as a tree over fixed token
  leaves, SP slices being subtrees;
- ``accumulation``: micro-batch groups (chains) folded by a tree, the DP levels by moving data;
- ``grad_norm``: the clipping norm from an exact, order-independent sum of squares;
- ``context_parallel``: under CP every sum over the sequence (weight GEMMs, token trees, the
  embedding, attention's dK/dV) on the whole micro-batch gathered in sequence order, and the DP x CP
  gradient sync over DP only (the CP copies are equal);
- ``embedding``: the embedding's gradient by the rows of its token ids; ``experts``: MoE;
  ``lm_head_grad``: the LM head's input gradient.

What ``numerics.MODES`` reads: the strategy class and ``register_patches`` (its patch entries).
"""
from .patches import register as register_patches
from .strategy import BitwiseTraining
