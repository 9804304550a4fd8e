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


def padded_tree_fold(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``tree_fold`` over any length: zero leaves appended up to a power of two (an exact zero
    added changes nothing, so this is the perfect tree the leaves are a prefix of)."""
    n = t.shape[dim]
    size = 1 << max(0, (n - 1).bit_length())
    if size != n:
        pad = list(t.shape)
        pad[dim] = size - n
        t = torch.cat([t, t.new_zeros(pad)], dim=dim)
    return tree_fold(t, dim=dim)
