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


def _add(left, right):
    """One node of the tree; None is an empty subtree, an exact +0.0 (x + 0.0 is x, except that
    -0.0 becomes +0.0, as adding a zero leaf does)."""
    if left is None:
        return None if right is None else right + 0.0
    return left + 0.0 if right is None else left + right


def fold_in_order(leaves, count: int):
    """The perfect tree over ``count`` (a power of two) leaves given in index order by the iterable
    ``leaves``, each a tensor or None (an empty subtree, see ``_add``); missing trailing leaves are
    empty. A binary counter: a finished subtree waits for its right sibling, so at most log2(count) + 1
    nodes are alive. Returns None when every leaf is empty."""
    if count < 1 or count & (count - 1):
        raise ValueError(f"fold_in_order needs a power-of-two number of leaves, got {count}")
    stack = []  # (subtree size, node), sizes strictly decreasing
    leaves = iter(leaves)
    for _ in range(count):
        node, size = next(leaves, None), 1
        while stack and stack[-1][0] == size:
            node, size = _add(stack.pop()[1], node), size * 2
        stack.append((size, node))
    if next(leaves, None) is not None:
        raise ValueError(f"fold_in_order: more than {count} leaves")
    return stack[0][1]


def dyadic_blocks(start: int, stop: int):
    """[start, stop) as maximal aligned power-of-two blocks (start, size), in order: the subtrees of a
    perfect tree over leaf indices that the range covers."""
    blocks = []
    while start < stop:
        size = start & -start if start else 1 << (stop - 1).bit_length()
        while start + size > stop:
            size //= 2
        blocks.append((start, size))
        start += size
    return blocks


def merge_blocks(nodes: dict):
    """Fold aligned subtrees ``{(start, size): node}`` that together tile a prefix of a perfect tree
    into its root, bottom-up in tree order; a missing sibling is an empty subtree (``_add``)."""
    nodes = dict(nodes)
    size = 1
    while len(nodes) > 1:
        for start, s in sorted(k for k in nodes if k[1] == size):
            if (start, s) not in nodes:
                continue
            left = start - s if start % (2 * s) else start
            pair = [nodes.pop((left, s), None), nodes.pop((left + s, s), None)]
            nodes[(left, 2 * s)] = _add(*pair)
        size *= 2
    return next(iter(nodes.values()))
