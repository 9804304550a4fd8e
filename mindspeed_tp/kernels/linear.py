"""Batch- and shard-invariant GEMMs (torch reference backend).

A row of the output depends only on that row of the input and on the weights: never on how many
rows were computed together, nor on which column shard of the weight a rank holds. On CPU BLAS
this holds once the row count is padded to a fixed multiple (MKL switches code path, and so its
K order, for small or odd M); measured in tests/test_linear_kernels.py.
"""
from typing import Optional

import torch

from ..backends import use_npu
from ..tree import tree_fold


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
    out = invariant_matmul(x2d, weight.t(), row_multiple)
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
    """The local subtree: the ``num_leaves`` fp32 leaf products folded in tree order, (M, N)."""
    return tree_fold(leaf_partials(x, weight, num_leaves, row_multiple), dim=0)
