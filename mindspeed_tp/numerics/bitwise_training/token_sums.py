"""Weight gradients of per-token layers (RMSNorm / LayerNorm, QK-norm) and of linear layers' added
biases (a row-parallel layer's, fc1's: ``TokenBias``) in canonical order.

``dw = sum over tokens of dy * x_hat`` (and ``db = sum of dy``): vanilla lets autograd reduce over
whatever tokens a rank holds, then Megatron all-reduces the ranks' sums over TP (SP norms, QK-norms
whose heads TP splits). Here the micro-batch's sequence is cut into C position leaves (s/C
positions of every sequence); inside a leaf its tokens ([s, b] order) are added by a perfect tree
(zero-padded to a power of two); the leaves by a perfect tree in sequence order. With SP a rank
holds C/TP leaves, a subtree. A QK-norm's leaves are (head, position leaf) pairs, heads outer, so a
rank's heads are a subtree. Each rank folds its subtree in fp32; the ranks' results are gathered
(moved, never summed) and every rank folds the top levels identically, so no later all-reduce is
needed (``patches.py`` skips Megatron's).
"""
from typing import Optional

import torch

from ...contract.refusals import refuse
from ...contract.tree import padded_tree_fold, tree_fold
from ...kernels.collectives import gather_along_rank, group_size
from .context_parallel import token_values


def token_tree_sum(values: torch.Tensor, seq_split: bool, heads: bool, group, c: int) -> torch.Tensor:
    """Canonical sum of fp32 ``values`` ([s, b, h] or [s, b, heads, h]) over everything but the last
    dim, in C = ``c`` position leaves. seq_split: dim 0 is this rank's SP slice; heads: dim 2 holds
    this rank's heads (QK-norm)."""
    tp = group_size(group)
    s_local = values.shape[0]
    leaves = c // tp if seq_split else c
    if s_local % leaves:
        raise refuse("bitwise_sequence_leaves", s=s_local * (tp if seq_split else 1), c=c)
    if heads and values.dim() != 4:
        raise ValueError(f"a QK-norm gradient needs [s, b, heads, h] values, got {tuple(values.shape)}")
    if not heads and values.dim() != 3:
        raise ValueError(f"a norm gradient needs [s, b, h] values, got {tuple(values.shape)}")
    v = values if heads else values.unsqueeze(2)                      # [s, b, H, h]
    s, b, hh, h = v.shape
    if heads and (hh & (hh - 1)):
        raise refuse("bitwise_heads_power_of_two", heads=hh * tp)
    # [leaves, tokens of a leaf, H, h] -> each leaf's tree over its tokens ([s, b] order)
    per_leaf = v.reshape(leaves, (s // leaves) * b, hh, h).transpose(0, 1)
    leaf_sums = padded_tree_fold(per_leaf)                                    # [leaves, H, h]
    local = tree_fold(leaf_sums.transpose(0, 1).reshape(hh * leaves, h), dim=0)  # heads outer
    if tp == 1 or not (seq_split or heads):
        return local
    return tree_fold(gather_along_rank(local, group), dim=0)           # ranks in order, moved


class TokenLeafScale(torch.autograd.Function):
    """``x * w (+ b)`` in fp32 with the parameter gradients as canonical token sums."""

    @staticmethod
    def forward(ctx, x, weight, bias, seq_split, heads, group, c):
        ctx.seq_split, ctx.heads, ctx.group, ctx.c = seq_split, heads, group, c
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        y = x * weight.float()
        return y + bias.float() if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.float()
        dx = grad * weight.float() if ctx.needs_input_grad[0] else None
        # under CP: the whole sequence's values (moved), the one-device tree (context_parallel.py)
        values, split = token_values(grad * x, ctx.seq_split, ctx.group)
        dw = token_tree_sum(values, split, ctx.heads, ctx.group, ctx.c).to(weight.dtype)
        db = None
        if ctx.has_bias:
            values, split = token_values(grad, ctx.seq_split, ctx.group)
            db = token_tree_sum(values, split, ctx.heads, ctx.group, ctx.c).to(weight.dtype)
        return dx, dw, db, None, None, None, None


def scale(x_hat: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], sequence_parallel: bool, group,
          c: int):
    """The norm's affine step under bitwise training (C = ``c``). 4-D inputs are QK-norms ([s, b,
    heads, h], heads split by TP); 3-D inputs are SP slices when the layer runs sequence parallel."""
    heads = x_hat.dim() == 4
    seq_split = bool(sequence_parallel) and not heads
    return TokenLeafScale.apply(x_hat, weight, bias, seq_split, heads, group, c)


class TokenBias(torch.autograd.Function):
    """``x + b`` in the model dtype (a linear layer's bias added to its output rows, as the forward adds
    it); backward: dx = dy, db the canonical token sum of dy."""

    @staticmethod
    def forward(ctx, x, bias, seq_split, group, c):
        ctx.seq_split, ctx.group, ctx.c, ctx.bias_dtype = seq_split, group, c, bias.dtype
        return x + bias

    @staticmethod
    def backward(ctx, grad):
        db = None
        if ctx.needs_input_grad[1]:
            values, split = token_values(grad.float(), ctx.seq_split, ctx.group)
            db = token_tree_sum(values, split, False, ctx.group, ctx.c).to(ctx.bias_dtype)
        return grad, db, None, None, None


def add_bias(x: torch.Tensor, bias: torch.Tensor, sequence_split: bool, group, c: int) -> torch.Tensor:
    """A bias added to a layer's output [s, b, n] under bitwise training (C = ``c``); sequence_split:
    dim 0 is this rank's SP slice (a row-parallel output under SP: the sum is folded across TP, so
    megatron's TP all-reduce of the bias gradient is skipped, as a norm's)."""
    return TokenBias.apply(x, bias, bool(sequence_split), group, c)
