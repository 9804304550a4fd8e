"""Context parallelism (CP) for the consistent attention: Megatron's data layout, the key/value
exchange and the attention of a rank's query chunks over the whole sequence's keys.

Layout (megatron-core's ``get_batch_on_this_cp_rank``; per packed sequence for thd, as
``get_thd_batch_on_this_cp_rank``): a sequence of length L is cut into 2·CP chunks of L/(2·CP);
rank r holds chunks r and 2·CP-1-r, in that order (the causal work is balanced).

Exchange: every rank's keys/values are all-gathered over the CP group and put back in sequence
order (a permutation: moving data, nothing is added), so each query runs the one-device procedure
-- the same key blocks aligned to absolute positions, visited in the same order, the same online
softmax -- and its output is bitwise the one-device output. An all-gather rather than a ring:
the consistent kernel's blocks are fixed by absolute key position and a query tile stops at its
last visible block, so it needs every earlier key block in order; a ring would deliver them out
of order (chunk 2·CP-1-r's queries need the blocks of every rank) and the block loop would have to
wait or buffer the same bytes anyway. The cost is the whole sequence's K/V per rank during one
layer's attention (``benchmarks/scale_bench.py`` measures it: a cp2 case next to its dp2 case).

Backward of the exchange: the gradient of a gathered key/value is summed over the CP ranks'
query contributions by the collective (an all-reduce, then each rank keeps its own chunks): the
default mode's "as megatron sums them". Bitwise training gathers by moving data in both directions
instead (``numerics/bitwise_training/context_parallel.py``: attention on the whole sequence's queries,
so no key gradient is summed over ranks).
"""
from __future__ import annotations

import functools
from typing import List, Sequence

import torch
import torch.distributed as dist

from . import dispatch
from .collectives import group_rank, group_size


def chunk_ids(cp_size: int, cp_rank: int) -> tuple:
    """The two of the 2·CP chunks rank ``cp_rank`` holds, in its local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions (within a sequence of ``length`` tokens, divisible by 2·CP) of the tokens rank
    ``cp_rank`` holds, in its local order: increasing."""
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} is not divisible by 2*context_parallel_size={2 * cp_size}")
    c = length // (2 * cp_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp_size, cp_rank)])


def packed_local_index(bounds: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Columns of the whole packed row (thd; sequence i in bounds[i]:bounds[i+1], each length
    divisible by 2·CP) that rank ``cp_rank`` holds, in its local order: per sequence its two chunks."""
    parts = [a + local_positions(b - a, cp_size, cp_rank) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def packed_local_positions(bounds: Sequence[int], cp_size: int, cp_rank: int) -> List[torch.Tensor]:
    """Per packed sequence: the positions (from the sequence's own 0) of the tokens this rank holds."""
    return [local_positions(b - a, cp_size, cp_rank) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def sequence_order(bounds: Sequence[int], cp_size: int) -> torch.Tensor:
    """perm with full[perm] = the ranks' local rows concatenated rank after rank, put back in sequence
    order: full row g comes from concatenated row perm[g]. bounds: [0, L] for one padded
    sequence, or the packed row's cu_seqlens."""
    return _sequence_order(tuple(int(b) for b in bounds), cp_size)


@functools.lru_cache(maxsize=64)  # every layer of a forward asks for the same batch's order
def _sequence_order(bounds: tuple, cp_size: int) -> torch.Tensor:
    local = packed_local_index(bounds, cp_size, 0).numel()
    owner = torch.empty(bounds[-1], dtype=torch.long)
    for r in range(cp_size):
        owner[packed_local_index(bounds, cp_size, r)] = r * local + torch.arange(local)
    return owner


class _GatherSequence(torch.autograd.Function):
    """All-gather the ranks' local rows (dim 0) and put them in sequence order. Backward: the
    gradient of every row summed over the CP ranks (all-reduce), this rank's rows kept."""

    @staticmethod
    def forward(ctx, x, perm, group):
        ctx.group, ctx.perm, ctx.local = group, perm, x.shape[0]
        world = group_size(group)
        flat = x.contiguous().reshape(x.shape[0], -1)
        out = flat.new_empty((world * flat.shape[0], flat.shape[1]))
        dist.all_gather_into_tensor(out, flat, group=group)
        return out.index_select(0, perm.to(out.device)).reshape(-1, *x.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        shape = grad.shape
        flat = grad.contiguous().reshape(shape[0], -1)
        concat = torch.empty_like(flat)
        concat.index_copy_(0, ctx.perm.to(flat.device), flat)
        dist.all_reduce(concat, group=ctx.group)
        mine = group_rank(ctx.group) * ctx.local
        return concat[mine:mine + ctx.local].reshape(ctx.local, *shape[1:]), None, None


def gather_sequence(x: torch.Tensor, bounds: Sequence[int], group) -> torch.Tensor:
    """x: this rank's rows (dim 0) -> the whole sequence (or packed row) in sequence order."""
    return _GatherSequence.apply(x, sequence_order(bounds, group_size(group)), group)


def cp_attention(q, k_full, v_full, scale, causal, q_positions, excluded, block_size, row_multiple, split_size,
                 window=None):
    """The consistent attention of this rank's queries q (b, hq, sq_local, d) at ``q_positions``
    over the whole sequence's keys k_full, v_full (b, hkv, S, d): the one-device procedure per query."""
    attend = dispatch.kernel("attention", q)
    return attend(q, k_full, v_full, scale, causal, q_positions, excluded, block_size, row_multiple, split_size,
                  window)


def packed_cp_attention(q, k_full, v_full, bounds, cp_size, cp_rank, scale, causal, block_size, row_multiple,
                        split_size, window=None):
    """Packed (thd) under CP: q (t_local, hq, d) this rank's rows, k_full / v_full (T, hkv, d) the
    whole packed row in sequence order, bounds its cu_seqlens. Each sequence's local queries at their
    own positions over that sequence's keys from its position 0: the one-device bits."""
    outs, start = [], 0
    for (a, b), pos in zip([(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a],
                           packed_local_positions(bounds, cp_size, cp_rank)):
        n = pos.numel()
        one_q = q[start:start + n].permute(1, 0, 2).unsqueeze(0)
        one_k, one_v = (x[a:b].permute(1, 0, 2).unsqueeze(0) for x in (k_full, v_full))
        out = cp_attention(one_q, one_k, one_v, scale, causal, pos.to(q.device), None, block_size, row_multiple,
                           split_size, window)
        outs.append(out.squeeze(0).permute(1, 0, 2))
        start += n
    return torch.cat(outs, dim=0) if outs else q.new_zeros(*q.shape[:-1], v_full.shape[-1])
