"""Column-parallel layers under bitwise training: the input gradient in canonical order.

A column-parallel layer (QKV, fc1, the LM head) splits its output features over TP, so its input
gradient ``dx = dy @ W`` is a sum over those features that vanilla Megatron adds in the collective
(the dgrad all-reduce, or the SP all-gather's backward reduce-scatter), each rank's bf16 partial
rounded first. Here the output features are cut into canonical leaves of a fixed width (C leaves
per part, or ``vocab_leaf_width`` rows for the LM head), each leaf's product is an fp32 GEMM of the
same shape in every layout, a rank folds its contiguous run of leaves (a subtree), and the ranks'
subtrees are folded by moving data (``kernels.collectives.fold_across_ranks``), cast once. An LM head
whose rank holds a non-power-of-two number of vocab leaves (a real vocabulary, e.g. 151936) folds its
range as aligned blocks and merges everyone's blocks in tree order (``fold_ranges``).

A gated fc1 (SwiGLU) holds two parts per rank, ``[gate_r; up_r]``: leaf i is gate chunk i
followed by up chunk i, so its rows are the same features in every layout. The LM head's padded
vocab rows have zero gradient, and a perfect tree with zero leaves appended is the same sum, so
Megatron's TP-dependent vocab padding does not change the bits.
"""
from typing import Optional

import torch
import torch.distributed as dist

from ...contract.profile import is_power_of_two
from ...contract.refusals import refuse
from ...kernels.collectives import _all_gather_rows, fold_across_ranks, group_size
from ...kernels.linear import _fold_leaves, invariant_weight_grad, leaf_partials
from ...kernels.logprob import vocab_leaf_width
from ...models.marks import OUTPUT_PARTS_ATTR, TIED_HEAD_ATTR
from . import accumulation



def _leaf_rows(n_local: int, parts: int, leaves: int, device) -> Optional[torch.Tensor]:
    """Row order putting leaf i's rows (chunk i of every part, part order) contiguously; None if
    the rows are in that order already (one part)."""
    if parts == 1:
        return None
    chunk = n_local // (parts * leaves)
    idx = torch.arange(n_local, device=device).view(parts, leaves, chunk).transpose(0, 1)
    return idx.reshape(-1)


def leaves_per_rank(weight: torch.Tensor, tp: int, vocab: Optional[int], prof) -> int:
    """How many canonical leaves this rank's output rows hold under profile ``prof``. The LM head's
    count may be any integer (``fold_ranges``); the other layers' is C/TP."""
    n_local = weight.shape[0]
    if vocab is not None:  # the LM head: leaves of the width the forward's vocab tree uses
        width = vocab_leaf_width(vocab, prof.canonical_shards, prof.vocab_pad_multiple)
        if n_local % width:
            raise refuse("bitwise_vocab_leaves", v_local=n_local, width=width, vocab=vocab)
        return n_local // width
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
    def forward(ctx, x, weight, group, sequence_parallel, out_dtype, leaves, compute, row_multiple):
        ctx.group, ctx.sp, ctx.leaves, ctx.row_multiple = group, sequence_parallel, leaves, row_multiple
        ctx.save_for_backward(x, weight)
        full = _gather_sequence(x, group) if sequence_parallel else x
        lead = full.shape[:-1]
        out = compute(full.reshape(-1, full.shape[-1]), weight, out_dtype)
        return out.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _gather_sequence(x, ctx.group) if ctx.sp else x
        lead = full.shape[:-1]
        x2d = full.reshape(-1, full.shape[-1])
        dtype = torch.promote_types(x.dtype, weight.dtype)
        dy = grad.reshape(-1, grad.shape[-1]).to(dtype)
        dw = invariant_weight_grad(dy, x2d.to(dtype), weight.dtype, ctx.row_multiple) if ctx.needs_input_grad[1] else None
        if dw is not None and getattr(weight, TIED_HEAD_ATTR, False):
            accumulation.add_tied_head_grad(weight, dw)  # kept apart from the embedding's (PP=1, tied)
            dw = None
        dx = None
        if ctx.needs_input_grad[0]:
            order = _leaf_rows(weight.shape[0], getattr(weight, OUTPUT_PARTS_ATTR, 1), ctx.leaves, weight.device)
            dyl, wl = (dy, weight) if order is None else (dy[:, order], weight[order])
            if is_power_of_two(ctx.leaves):  # this rank's leaves are one subtree
                # x = dy's leaf columns, "weight" = W^T: leaf i is dy[:, leaf_i] @ W[leaf_i, :] in fp32.
                partial = _fold_leaves(dyl, wl.t().to(dtype), ctx.leaves, ctx.row_multiple)
                partial = partial.reshape(*lead, partial.shape[-1])
                dx = fold_across_ranks(partial, ctx.group, x.dtype, scatter_dim0=ctx.sp)
            else:  # an LM head whose rank holds a non-power-of-two run of vocab leaves
                dx = fold_ranges(dyl, wl.t().to(dtype), ctx.leaves, ctx.group, x.dtype, ctx.sp, ctx.row_multiple).reshape(
                    *(lead if not ctx.sp else (lead[0] // group_size(ctx.group), *lead[1:])), -1)
        return dx, dw, None, None, None, None, None, None


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


def fold_ranges(dy: torch.Tensor, w_t: torch.Tensor, leaves: int, group, out_dtype, scatter: bool,
                row_multiple: int) -> torch.Tensor:
    """The canonical tree over every rank's ``leaves`` leaves (rank r: leaves [r*leaves, (r+1)*leaves))
    when that count is not a power of two: each rank folds its range's aligned blocks (subtrees),
    the blocks move to the rank owning each row slice (all-to-all), and every rank merges all the
    blocks bottom-up in tree order -- a missing sibling is the zero subtree past the end. Returns
    this rank's row slice (scatter) or all rows, cast."""
    tp = group_size(group)
    rank = dist.get_rank(group=group) if tp > 1 else 0
    rows = dy.shape[0]
    width = dy.shape[1] // leaves
    ranges = [dyadic_blocks(r * leaves, (r + 1) * leaves) for r in range(tp)]
    most = max(len(b) for b in ranges)
    mine = []
    for start, size in ranges[rank]:
        cols = slice((start - rank * leaves) * width, (start - rank * leaves + size) * width)
        if size == 1:  # the GEMM a leaf gets inside a pair elsewhere: paired with a zero leaf (+0 exact)
            a, b = dy[:, cols], w_t[:, cols]
            pair = leaf_partials(torch.cat([a, torch.zeros_like(a)], 1), torch.cat([b, torch.zeros_like(b)], 1), 2,
                                 row_multiple)
            mine.append(pair[0] + pair[1])
        else:
            mine.append(_fold_leaves(dy[:, cols], w_t[:, cols], size, row_multiple))
    padded = -(-rows // tp) * tp
    stack = torch.zeros(most, padded, w_t.shape[0], dtype=torch.float32, device=dy.device)
    for i, block in enumerate(mine):
        stack[i, :rows] = block
    if tp > 1:  # slot s of the result: rank s's blocks for this rank's rows
        send = stack.reshape(most, tp, padded // tp, -1).transpose(0, 1).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
    else:
        received = stack.reshape(most, 1, padded, -1).transpose(0, 1)
    nodes = {}
    for r in range(tp):
        for i, block in enumerate(ranges[r]):
            nodes[block] = received[r, i]
    size = 1
    while len(nodes) > 1:
        for start, s in sorted(k for k in nodes if k[1] == size):
            if (start, s) not in nodes:
                continue
            left = start - s if start % (2 * s) else start
            pair = [(left, s), (left + s, s)]
            parts = [nodes.pop(p) for p in pair if p in nodes]
            # A missing sibling is the zero subtree past the end: added, as a padded perfect tree adds
            # its zero leaves (x + 0.0 is x, except that -0.0 becomes +0.0 as it does there).
            nodes[(left, 2 * s)] = parts[0] + (parts[1] if len(parts) == 2 else 0.0)
        size *= 2
    slice_rows = next(iter(nodes.values())).to(out_dtype)
    if scatter:
        return slice_rows
    full = _all_gather_rows(slice_rows.contiguous(), group) if tp > 1 else slice_rows
    return full[:rows]


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    full = _all_gather_rows(x.reshape(x.shape[0], -1), group)
    return full.reshape(-1, *x.shape[1:])


def column_linear(x, weight, group, sequence_parallel: bool, out_dtype, compute, prof, vocab: Optional[int] = None):
    """The column-parallel GEMM under bitwise training with profile ``prof``. ``compute(x2d, weight,
    out_dtype)`` is the forward's invariant GEMM; ``vocab``: the true vocab size when this is the LM head."""
    leaves = leaves_per_rank(weight, group_size(group), vocab, prof)
    return CanonicalColumnLinear.apply(x, weight, group, bool(sequence_parallel), out_dtype, leaves, compute,
                                       prof.gemm_row_multiple)
