"""Batch- and shard-invariant GEMMs and the canonical-tree leaves of row-parallel layers.

A row of the output depends only on that row of the input and on the weights: never on how many
rows were computed together, nor on which column shard of the weight a rank holds (each backend's
``matmul`` / ``linear`` primitive promises it). One backward policy for every backend: the plain
GEMMs an unpatched linear runs, through the backend's ``grad_matmul``, unless the strategy passes
an ``InvariantBackward`` (bitwise training).
"""
from typing import Optional

import torch

from . import dispatch


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, row_multiple: int = 16) -> torch.Tensor:
    """fp32 ``a @ b`` for ``a`` (..., M, K) and ``b`` (..., K, N), row-invariant in M."""
    return dispatch.kernel("matmul", a)(a, b, row_multiple)


def _invariant_product(a: torch.Tensor, b_t: torch.Tensor, out_dtype: torch.dtype, row_multiple: int) -> torch.Tensor:
    """``a @ b_t.T`` for a (M, K), b_t (N, K) by the backend's invariant ``linear``."""
    if a.dtype != b_t.dtype:
        dtype = torch.promote_types(a.dtype, b_t.dtype)
        a, b_t = a.to(dtype), b_t.to(dtype)
    return dispatch.kernel("linear", a)(a, b_t, out_dtype, row_multiple)


def invariant_input_grad(dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                         row_multiple: int) -> torch.Tensor:
    """dx = dy (T, N) @ weight (N, K) by the invariant GEMM (bitwise training), cast once."""
    return _invariant_product(dy, weight.t(), out_dtype, row_multiple)


def invariant_weight_grad(dy: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype,
                          row_multiple: int) -> torch.Tensor:
    """dW = dy^T (N, T) @ x (T, K) by the invariant GEMM (bitwise training): the micro-batch's
    tokens in their given order, fp32-accumulated, cast once."""
    return _invariant_product(dy.t(), x.t(), out_dtype, row_multiple)


class InvariantBackward:
    """The backward policy of bitwise training: dx and dW by the invariant GEMM, so a row-parallel
    layer's gradients never depend on the shard."""

    def __init__(self, row_multiple: int):
        self.row_multiple = row_multiple

    def input_grad(self, dy, weight, out_dtype):
        return invariant_input_grad(dy, weight, out_dtype, self.row_multiple)

    def weight_grad(self, dy, x, out_dtype):
        return invariant_weight_grad(dy, x, out_dtype, self.row_multiple)


class _PlainBackward(torch.autograd.Function):
    """``compute(x, w)`` (an invariant fp32-accumulating product of x (M, K) and w (N, K)) with the
    backward an unpatched linear has: dx = dy @ w and dw = dy^T @ x in the inputs' dtype (the wider
    of the two, e.g. fp32 for a bf16 input to an fp32 router).

    With an ``InvariantBackward`` policy (bitwise training) both products are the invariant GEMM
    instead: a row-parallel layer's dx and dW then never depend on the shard.

    Otherwise only the forward must be bitwise layout-invariant (it gives the logprobs); letting autograd
    differentiate the invariant kernel would keep fp32 copies of x and w and every leaf product
    alive for the backward and run it as fp32 GEMMs, where vanilla keeps x and runs bf16 GEMMs.
    """

    @staticmethod
    def forward(ctx, x, weight, compute, policy):
        ctx.save_for_backward(x, weight)
        ctx.policy = policy
        return compute(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dtype = torch.promote_types(x.dtype, weight.dtype)
        grad = grad.to(dtype)
        policy = ctx.policy
        if policy is not None:
            dx = policy.input_grad(grad, weight.to(dtype), x.dtype) if ctx.needs_input_grad[0] else None
            dw = policy.weight_grad(grad, x.to(dtype), weight.dtype) if ctx.needs_input_grad[1] else None
            return dx, dw, None, None
        gemm = dispatch.kernel("grad_matmul", grad)
        dx = gemm(grad, weight.to(dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = gemm(grad.t(), x.to(dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def with_plain_backward(x2d: torch.Tensor, weight: torch.Tensor, compute,
                        backward: Optional[InvariantBackward] = None):
    """``compute(x2d, weight)`` (any forward GEMM, e.g. an engine's) with the plain backward, or
    ``backward``'s invariant GEMMs, whatever ``compute`` is."""
    if torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad):
        return _PlainBackward.apply(x2d, weight, compute, backward)
    return compute(x2d, weight)


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    row_multiple: int = 16,
    backward: Optional[InvariantBackward] = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` accumulated in fp32 and cast once to ``out_dtype`` (default x's);
    ``backward``: the strategy's backward policy (None: the plain GEMMs)."""
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if bias is None:
        linear = dispatch.kernel("linear", x2d)
        out = with_plain_backward(x2d, weight, lambda a, w: linear(a, w, out_dtype, row_multiple), backward)
        return out.reshape(*lead, weight.shape[0])
    linear = dispatch.kernel("linear", x2d)
    out = with_plain_backward(x2d, weight, lambda a, w: linear(a, w, torch.float32, row_multiple), backward)
    return (out + bias.float()).to(out_dtype).reshape(*lead, weight.shape[0])


def invariant_linear_values(xs, weights, out_dtype: Optional[torch.dtype] = None, row_multiple: int = 16):
    """``[invariant_linear(x, w, out_dtype=...) for ...]``'s values for 2-D ``xs`` (no bias, no autograd: wrap
    each with ``with_plain_backward`` or the strategy's Function): by the backend's ``grouped_linear``
    where it has one (many small products in shared tiles, the same bits), else one ``linear`` each."""
    if not xs:
        return []
    out_dtype = out_dtype or xs[0].dtype
    grouped = dispatch.backend_attribute(xs[0], "grouped_linear")
    with torch.no_grad():
        if grouped is not None:
            return grouped(list(xs), list(weights), out_dtype, row_multiple)
        return [dispatch.kernel("linear", x)(x, w, out_dtype, row_multiple) for x, w in zip(xs, weights)]


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
    x: torch.Tensor, weight: torch.Tensor, num_leaves: int, row_multiple: int = 16,
    backward: Optional[InvariantBackward] = None,
) -> torch.Tensor:
    """The local subtree: the ``num_leaves`` fp32 leaf products folded in tree order, (M, N).

    Leaves are computed two at a time and folded as they come (a binary counter: a finished
    subtree waits on a stack for its right sibling), so at most log2(num_leaves) + 1 partial
    products are alive instead of num_leaves; the additions are exactly tree_fold's. Backward:
    the plain GEMMs (_PlainBackward), or ``backward``'s.
    """
    if num_leaves < 1 or num_leaves & (num_leaves - 1):
        raise ValueError(f"folded_leaf_partials needs a power-of-two number of leaves, got {num_leaves}")
    return with_plain_backward(x, weight, lambda a, w: fold_leaf_products(a, w, num_leaves, row_multiple), backward)


def fold_leaf_products(x: torch.Tensor, weight: torch.Tensor, num_leaves: int, row_multiple: int) -> torch.Tensor:
    """``folded_leaf_partials``'s value without its autograd Function: x (M, K) times weight (N, K)
    cut along K into ``num_leaves`` leaves, their fp32 products folded in tree order as they come.
    For code inside an autograd Function's forward or backward."""
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
