"""Batch- and shard-invariant GEMMs (torch reference backend).

A row of the output depends only on that row of the input and on the weights: never on how many
rows were computed together, nor on which column shard of the weight a rank holds. On CPU BLAS
this holds once the row count is padded to a fixed multiple (MKL switches code path, and so its
K order, for small or odd M); measured in tests/test_linear_kernels.py.
"""
from typing import Optional

import torch

from ..backends import use_npu


def _pad_rows(x2d: torch.Tensor, multiple: int) -> torch.Tensor:
    rows = x2d.shape[-2]
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return x2d
    pad = x2d.new_zeros(*x2d.shape[:-2], padded - rows, x2d.shape[-1])
    return torch.cat([x2d, pad], dim=-2)


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, row_multiple: int = 16) -> torch.Tensor:
    """fp32 ``a @ b`` for ``a`` (..., M, K) and ``b`` (..., K, N), row-invariant in M."""
    if use_npu(a):
        from . import npu

        return npu.matmul(a, b)
    rows = a.shape[-2]
    out = torch.matmul(_pad_rows(a.float(), row_multiple), b.float())
    return out[..., :rows, :]


class _PlainBackward(torch.autograd.Function):
    """``compute(x, w)`` (an invariant fp32-accumulating product of x (M, K) and w (N, K)) with the
    backward an unpatched linear has: dx = dy @ w and dw = dy^T @ x in the inputs' dtype (the wider
    of the two, e.g. fp32 for a bf16 input to an fp32 router).

    Only the forward must be bitwise layout-invariant (it gives the logprobs); letting autograd
    differentiate the invariant kernel would keep fp32 copies of x and w and every leaf product
    alive for the backward and run it as fp32 GEMMs, where vanilla keeps x and runs bf16 GEMMs.
    """

    @staticmethod
    def forward(ctx, x, weight, compute):
        ctx.save_for_backward(x, weight)
        return compute(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dtype = torch.promote_types(x.dtype, weight.dtype)
        grad = grad.to(dtype)
        dx = (grad @ weight.to(dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (grad.t() @ x.to(dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _with_plain_backward(x2d: torch.Tensor, weight: torch.Tensor, compute):
    if torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad):
        return _PlainBackward.apply(x2d, weight, compute)
    return compute(x2d, weight)


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    row_multiple: int = 16,
) -> torch.Tensor:
    """``x @ weight.T + bias`` accumulated in fp32 and cast once to ``out_dtype`` (default x's)."""
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if use_npu(x):
        from . import npu

        out = npu.matmul(x2d, weight.t())
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype).reshape(*lead, weight.shape[0])
    if (bias is None and x.dtype == weight.dtype == out_dtype == torch.bfloat16 and x.device.type == "cpu"):
        # CPU bf16: oneDNN's bf16 GEMM accumulates in fp32 and rounds once, 2-2.5x faster than an
        # fp32 GEMM of upcast inputs; row- and shard-invariant once rows are padded (tested).
        out = torch.matmul(_pad_rows(x2d, row_multiple), weight.t())[: x2d.shape[0]]
        return out.reshape(*lead, weight.shape[0])
    out = _with_plain_backward(x2d, weight, lambda a, w: invariant_matmul(a, w.t(), row_multiple))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).reshape(*lead, weight.shape[0])


def leaf_partials(
    x: torch.Tensor, weight: torch.Tensor, num_leaves: int, row_multiple: int = 16
) -> torch.Tensor:
    """fp32 partial products of the ``num_leaves`` contiguous K-slices held locally.

    x: (M, K_local), weight: (N, K_local). Returns (num_leaves, M, N); leaf i is
    ``x[:, slice_i] @ weight[:, slice_i].T`` computed with the same shape in every layout.
    """
    rows, k_local = x.shape
    if k_local % num_leaves:
        raise ValueError(f"local K={k_local} is not divisible into {num_leaves} leaves")
    kl = k_local // num_leaves
    xs = x.reshape(rows, num_leaves, kl).transpose(0, 1)  # (L, M, kl)
    ws = weight.reshape(weight.shape[0], num_leaves, kl).permute(1, 2, 0)  # (L, kl, N)
    return invariant_matmul(xs, ws, row_multiple)


def folded_leaf_partials(
    x: torch.Tensor, weight: torch.Tensor, num_leaves: int, row_multiple: int = 16
) -> torch.Tensor:
    """The local subtree: the ``num_leaves`` fp32 leaf products folded in tree order, (M, N).

    Leaves are computed two at a time and folded as they come (a binary counter: a finished
    subtree waits on a stack for its right sibling), so at most log2(num_leaves) + 1 partial
    products are alive instead of num_leaves; the additions are exactly tree_fold's. Backward:
    the plain GEMMs (_PlainBackward).
    """
    if num_leaves < 1 or num_leaves & (num_leaves - 1):
        raise ValueError(f"folded_leaf_partials needs a power-of-two number of leaves, got {num_leaves}")
    return _with_plain_backward(x, weight, lambda a, w: _fold_leaves(a, w, num_leaves, row_multiple))


def _fold_leaves(x: torch.Tensor, weight: torch.Tensor, num_leaves: int, row_multiple: int) -> torch.Tensor:
    if num_leaves == 1:
        return leaf_partials(x, weight, 1, row_multiple)[0]
    kl = x.shape[-1] // num_leaves
    stack = []  # (subtree size, its sum), sizes strictly decreasing
    for i in range(0, num_leaves, 2):
        cols = slice(i * kl, (i + 2) * kl)
        pair = leaf_partials(x[:, cols], weight[:, cols], 2, row_multiple)
        node, size = pair[0] + pair[1], 2
        while stack and stack[-1][0] == size:
            node, size = stack.pop()[1] + node, size * 2
        stack.append((size, node))
    return stack[0][1]
