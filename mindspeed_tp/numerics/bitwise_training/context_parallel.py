"""Bitwise training under context parallelism (CP): every sum over a CP-split sequence in the
one-device order, by moving data only.

A CP rank holds chunks r and 2·CP-1-r of every sequence (``kernels/context_parallel.py``). Its
backward needs sums over the whole sequence: a weight gradient is one GEMM over the micro-batch's
tokens, a norm weight's a token tree, the embedding's a backward over the token ids (``embedding.py``), and
dK/dV are folded over the query tiles in query order. Each is computed here on the whole
micro-batch: the operands (activations and output gradients of the rank's tokens) are all-gathered
over the CP group and put back in sequence order (a permutation: nothing is added), then the one-device
computation runs on them, so every CP rank holds the one-device micro-batch gradient. Attention
runs on the whole sequence's queries (``WholeSequence`` in, ``LocalRows`` out): its backward gets
the whole sequence's output gradient by an all-gather and takes this rank's rows of dQ/dK/dV.
No collective ever sums a gradient. Cost: the weight-gradient GEMMs, the embedding and the
attention backward run once per CP rank on the whole micro-batch (CP times the one-rank work), the
operands travel once per layer.

The CP copies of a gradient are then equal, so the DP x CP gradient sync folds the DP ranks' values
only, one CP copy each (``accumulation.reduce_over_dp_cp``), never adding a CP copy.

Padded (bshd) sequences only: a rank's rows are [s_local, b, ...] in Megatron's s-major order, its
two chunks the two halves. Packed (thd) sequences stay refused (``bitwise_context_parallel``).
"""
from __future__ import annotations

import torch

from ...kernels import context_parallel as cp
from ...kernels.collectives import all_gather_rows, gather_along_rank, group_rank, group_size
from ...kernels.linear import InvariantBackward


def cp_group():
    """Megatron's context-parallel group, or None at CP = 1 (or before the parallel state exists)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group if group is not None and group_size(group) > 1 else None


def gather_rows(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """This rank's tokens along ``dim`` (its two chunks, s-major: the two halves) -> the whole
    sequence in order, on every rank. Data moved, nothing added. Not differentiable."""
    size = group_size(group)
    if size == 1:
        return x
    if x.dtype == torch.bool:  # a mask: moved as bytes
        return gather_rows(x.to(torch.uint8), group, dim).bool()
    x = x.movedim(dim, 0)
    n = x.shape[0]
    if n % 2:
        raise ValueError(f"a CP rank holds two equal chunks; got {n} rows")
    order = cp.sequence_order([0, size * n], size).to(x.device)  # the default mode's K/V order
    full = all_gather_rows(x.reshape(n, -1), group).index_select(0, order).reshape(size * n, *x.shape[1:])
    return full.movedim(0, dim)


def local_rows(full: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """The whole sequence along ``dim`` -> this rank's two chunks, in its local order."""
    size = group_size(group)
    if size == 1:
        return full
    rows = cp.local_positions(full.shape[dim], size, group_rank(group), device=full.device)
    return full.index_select(dim, rows)


class WholeSequence(torch.autograd.Function):
    """Local rows -> the whole sequence (all-gather, sequence order). Backward: the gradient of the
    whole sequence is the same on every CP rank (computed from gathered operands), so this rank's
    rows of it are kept; nothing is summed."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return gather_rows(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return local_rows(grad, ctx.group, ctx.dim).contiguous(), None, None


class LocalRows(torch.autograd.Function):
    """The whole sequence -> this rank's rows. Backward: the ranks' row gradients all-gathered into
    the whole sequence's (moved), so what comes before runs its backward on the whole sequence."""

    @staticmethod
    def forward(ctx, full, group, dim):
        ctx.group, ctx.dim = group, dim
        return local_rows(full, group, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad.contiguous(), ctx.group, ctx.dim), None, None


def whole_sequence(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    return WholeSequence.apply(x, group, dim)


def this_ranks_rows(full: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    return LocalRows.apply(full, group, dim)


def weight_grad_operands(dy: torch.Tensor, x: torch.Tensor):
    """A weight gradient's operands (T_local, N) and (T_local, K), rows s-major -> the whole
    micro-batch's, so the invariant GEMM adds the one-device tokens in the one-device order."""
    group = cp_group()
    if group is None:
        return dy, x
    return gather_rows(dy, group), gather_rows(x, group)


def token_values(values: torch.Tensor, seq_split: bool, tp_group) -> tuple:
    """A norm's per-token values [s, b, ...] (this rank's tokens; seq_split: an SP slice of them) ->
    (the whole sequence's values, False): the canonical token tree then runs on the whole sequence,
    the same leaves and additions as on one device. Unchanged at CP = 1."""
    group = cp_group()
    if group is None:
        return values, seq_split
    if seq_split and group_size(tp_group) > 1:
        values = all_gather_rows(values.contiguous(), tp_group)  # the SP slices in rank order: moved
    return gather_rows(values.contiguous(), group), False


def _dp_cp_coordinates(group):
    """(dp rank, cp rank) of every member of the DP x CP ``group``, in group-rank order."""
    from megatron.core import parallel_state as ps

    mine = torch.tensor([ps.get_data_parallel_rank(), ps.get_context_parallel_rank()], dtype=torch.int64)
    return gather_along_rank(mine, group).tolist()


def cp_copy_members(group, dp_order) -> list:
    """The members of the DP x CP ``group`` whose copy of a gradient every CP rank holds whole is the
    one taken: the CP-rank-0 member of each DP rank, in ``dp_order``."""
    source = {d: i for i, (d, c) in enumerate(_dp_cp_coordinates(group)) if c == 0}
    return [source[d] for d in dp_order]


class WholeSequenceBackward(InvariantBackward):
    """Bitwise training's backward policy (the invariant GEMMs), the weight gradient's operands
    gathered over CP first: the one-device GEMM over the whole micro-batch on every CP rank."""

    def weight_grad(self, dy, x, out_dtype):
        dy, x = weight_grad_operands(dy, x)
        return super().weight_grad(dy, x, out_dtype)
