"""Canonical tree reduction: a perfect binary tree over leaves in index order.

Folding a contiguous run of leaves locally and then folding the per-rank results in rank order
visits exactly the same additions as folding all leaves at once, which is what makes every
TP size that divides C produce the same bits.
"""
import torch


def tree_fold(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum ``t`` over ``dim`` (a power-of-two length) as ((l0+l1)+(l2+l3))+... ."""
    n = t.shape[dim]
    if n < 1 or n & (n - 1):
        raise ValueError(f"tree_fold needs a power-of-two number of leaves, got {n}")
    t = t.movedim(dim, 0)
    while t.shape[0] > 1:
        t = t[0::2] + t[1::2]
    return t[0]
