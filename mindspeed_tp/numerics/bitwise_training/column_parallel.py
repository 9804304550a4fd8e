"""Column-parallel layers under bitwise training: the input gradient in canonical order.

A column-parallel layer (QKV, fc1, the LM head) splits its output features over TP, so its input
gradient ``dx = dy @ W`` is a sum over those features that vanilla Megatron adds in the collective
(the dgrad all-reduce, or the SP all-gather's backward reduce-scatter), each rank's bf16 partial
rounded first. Here the output features are cut into canonical leaves of a fixed width (C leaves
per part, or ``vocab_leaf_width`` rows for the LM head), each leaf's product is an fp32 GEMM of the
same shape in every layout, a rank folds its contiguous run of leaves (a subtree), and the ranks'
subtrees are folded by moving data (``kernels.collectives.fold_across_ranks``), cast once. The LM
head's tree is over wide vocab leaves on canonical vocab shards (``lm_head_grad``).

A bias (Qwen2's QKV bias) is added to the fp32 product before the one cast, as the scoring forward
adds it (``kernels.linear.invariant_linear``); its gradient is the weight gradient's GEMM against a
column of ones: the micro-batch's tokens summed in the same fixed order in every layout.

A gated fc1 (SwiGLU) holds two parts per rank, ``[gate_r; up_r]``: leaf i is gate chunk i
followed by up chunk i, so its rows are the same features in every layout.
"""
from typing import Optional

import torch

from ...contract.refusals import refuse
from ...kernels.collectives import all_gather_rows, fold_across_ranks, group_size
from ...kernels.linear import fold_leaf_products, invariant_weight_grad
from ...models.marks import OUTPUT_PARTS_ATTR
from .context_parallel import weight_grad_operands
from .lm_head_grad import lm_head_input_grad


def leaf_rows(n_local: int, parts: int, leaves: int, device) -> Optional[torch.Tensor]:
    """Row order putting leaf i's rows (chunk i of every part, part order) contiguously; None if
    the rows are in that order already (one part)."""
    if parts == 1:
        return None
    chunk = n_local // (parts * leaves)
    idx = torch.arange(n_local, device=device).view(parts, leaves, chunk).transpose(0, 1)
    return idx.reshape(-1)


def leaves_per_rank(weight: torch.Tensor, tp: int, prof) -> int:
    """How many canonical leaves this rank's output rows hold under profile ``prof``: C/TP."""
    n_local = weight.shape[0]
    parts = getattr(weight, OUTPUT_PARTS_ATTR, 1)
    leaves = prof.canonical_shards // tp
    if n_local % (parts * leaves):
        raise refuse("bitwise_column_indivisible", n=n_local * tp, parts=parts, c=prof.canonical_shards)
    return leaves


class CanonicalColumnLinear(torch.autograd.Function):
    """Forward: gather the SP slices (moved, not summed), one invariant GEMM. Backward: dW by the
    invariant GEMM over the micro-batch's tokens, dx by the canonical leaf tree folded across TP
    (SP: each rank keeps its sequence slice)."""

    @staticmethod
    def forward(ctx, x, weight, group, sequence_parallel, out_dtype, leaves, compute, row_multiple, bias):
        ctx.group, ctx.sp, ctx.leaves, ctx.row_multiple = group, sequence_parallel, leaves, row_multiple
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight)
        full = gather_sequence(x, group) if sequence_parallel else x
        lead = full.shape[:-1]
        x2d = full.reshape(-1, full.shape[-1])
        if bias is None:
            out = compute(x2d, weight, out_dtype)
        else:  # fp32 product + bias, one cast (as the scoring forward)
            out = (compute(x2d, weight, torch.float32) + bias.float()).to(out_dtype)
        return out.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = gather_sequence(x, ctx.group) if ctx.sp else x
        lead = full.shape[:-1]
        x2d = full.reshape(-1, full.shape[-1])
        dtype = torch.promote_types(x.dtype, weight.dtype)
        dy = grad.reshape(-1, grad.shape[-1]).to(dtype)
        dw = dbias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[8]:
            # under CP: the whole micro-batch's tokens (context_parallel.py)
            dy_all, x_all = weight_grad_operands(dy, x2d.to(dtype))
            if ctx.needs_input_grad[1]:
                dw = invariant_weight_grad(dy_all, x_all, weight.dtype, ctx.row_multiple)
            if ctx.needs_input_grad[8]:
                dbias = bias_grad(dy_all, ctx.bias_dtype, ctx.row_multiple)
        dx = None
        if ctx.needs_input_grad[0] and isinstance(ctx.leaves, tuple):  # the LM head
            vocab, shards, width = ctx.leaves
            dx = lm_head_input_grad(dy, weight.to(dtype), ctx.group, vocab, shards, width, x.dtype, ctx.sp,
                                    ctx.row_multiple).reshape(*x.shape)
        elif ctx.needs_input_grad[0]:
            order = leaf_rows(weight.shape[0], getattr(weight, OUTPUT_PARTS_ATTR, 1), ctx.leaves, weight.device)
            dyl, wl = (dy, weight) if order is None else (dy[:, order], weight[order])
            # x = dy's leaf columns, "weight" = W^T: leaf i is dy[:, leaf_i] @ W[leaf_i, :] in fp32.
            partial = fold_leaf_products(dyl, wl.t().to(dtype), ctx.leaves, ctx.row_multiple)
            partial = partial.reshape(*lead, partial.shape[-1])
            dx = fold_across_ranks(partial, ctx.group, x.dtype, scatter_dim0=ctx.sp)
        return dx, dw, None, None, None, None, None, None, dbias


def bias_grad(dy: torch.Tensor, dtype, row_multiple: int) -> torch.Tensor:
    """A bias's gradient: the rows of ``dy`` summed by the weight gradient's invariant GEMM against a
    column of ones (the same fixed order as the weight's)."""
    ones = torch.ones(dy.shape[0], 1, dtype=dy.dtype, device=dy.device)
    return invariant_weight_grad(dy, ones, dtype, row_multiple).reshape(-1)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The SP slices of ``x`` (sequence first) gathered in rank order: the whole sequence (no autograd)."""
    if group_size(group) == 1:
        return x
    full = all_gather_rows(x.reshape(x.shape[0], -1), group)
    return full.reshape(-1, *x.shape[1:])


def column_linear(x, weight, group, sequence_parallel: bool, out_dtype, compute, prof, vocab: Optional[int] = None,
                  bias: Optional[torch.Tensor] = None):
    """The column-parallel GEMM under bitwise training with profile ``prof``. ``compute(x2d, weight,
    out_dtype)`` is the forward's invariant GEMM; ``vocab``: the true vocab size when this is the LM head;
    ``bias``: this rank's slice of the layer's bias."""
    if vocab is not None:
        leaves = (vocab, prof.canonical_shards, prof.lm_head_grad_leaf_width)
    else:
        leaves = leaves_per_rank(weight, group_size(group), prof)
    return CanonicalColumnLinear.apply(x, weight, group, bool(sequence_parallel), out_dtype, leaves, compute,
                                       prof.gemm_row_multiple, bias)
