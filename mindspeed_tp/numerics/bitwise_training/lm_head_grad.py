"""The LM head's input gradient under bitwise training: wide vocab leaves on canonical shards.

``dx = dy @ W`` sums over the vocabulary. The canonical tree is defined on the true vocab V alone:
C canonical shards of S = ceil(V / C) rows (shard s: rows [s*S, (s+1)*S), clipped at V), each cut into
leaves of ``lm_head_grad_leaf_width`` rows (the last one shorter), a shard's leaves zero-padded to a
power of two. Each leaf is one fp32 GEMM of the same shape in every layout; a shard is a perfect tree
over its leaves and the C shards a perfect tree above them, empty leaves and shards adding +0.0.

Megatron pads the vocab by a TP-dependent multiple, so rank r of TP holds rows [r*v_local, (r+1)*v_local)
while its canonical shards are rows [r*S*C/TP, (r+1)*S*C/TP): the few rows in between (fewer than
the padding, per boundary) move to their canonical rank first (one all-to-all of dy's columns and W's
rows), then each rank folds its shards' subtree and the ranks' subtrees are folded by moving data
(``fold_across_ranks``), as every other column-parallel layer's. Rows past V (padding) take no part.
Wide leaves keep every GEMM large: at V = 151936 and C = 8, 80 GEMMs of K <= 2048 replace 9496 leaves of
16 rows (268x one plain GEMM, measured before this module).
"""
import math
from typing import List, Tuple

import torch
import torch.distributed as dist

from ...contract.tree import fold_in_order
from ...kernels.collectives import fold_across_ranks, group_rank, group_size
from ...kernels.linear import invariant_matmul


def canonical_rows(vocab: int, shards: int, tp: int, rank: int) -> Tuple[int, int]:
    """The vocab rows [lo, hi) whose leaves rank ``rank`` of ``tp`` folds: its C/TP canonical shards."""
    per_rank = math.ceil(vocab / shards) * (shards // tp)
    return min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab)


def _held_rows(v_local: int, vocab: int, rank: int) -> Tuple[int, int]:
    """The true vocab rows megatron's rank holds (its padded shard, clipped at V)."""
    return min(rank * v_local, vocab), min((rank + 1) * v_local, vocab)


def _overlap(a: Tuple[int, int], b: Tuple[int, int]) -> Tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else (lo, lo)


class _Rows:
    """This rank's canonical rows of dy (as columns) and W, from contiguous pieces in row order."""

    def __init__(self):
        self.pieces: List[Tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (start, stop, dy cols, W rows)

    def add(self, start: int, stop: int, dy: torch.Tensor, w: torch.Tensor) -> None:
        if stop > start:
            self.pieces.append((start, stop, dy, w))

    def take(self, start: int, stop: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """dy (M, stop - start) and W (stop - start, H), both contiguous, for global rows [start, stop)."""
        dys, ws = [], []
        for a, b, dy, w in sorted(self.pieces, key=lambda p: p[0]):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                dys.append(dy[:, lo - a:hi - a])
                ws.append(w[lo - a:hi - a])
        if sum(d.shape[1] for d in dys) != stop - start:
            raise RuntimeError(f"LM-head gradient: rows [{start}, {stop}) not all present on this rank")
        # Contiguous operands either way: the library sees the same strides whichever rank computes.
        if len(dys) == 1:
            return dys[0].contiguous(), ws[0].contiguous()
        return torch.cat(dys, dim=1), torch.cat(ws, dim=0)


def _exchange(dy: torch.Tensor, weight: torch.Tensor, vocab: int, shards: int, group) -> _Rows:
    """Each rank's canonical rows: its own held rows that stay, plus the rows other ranks hold (one
    all-to-all of [dy^T | W] rows; every rank computes the same plan, so all take part or none)."""
    tp, rank, v_local = group_size(group), group_rank(group), weight.shape[0]
    held = [_held_rows(v_local, vocab, r) for r in range(tp)]
    wanted = [canonical_rows(vocab, shards, tp, r) for r in range(tp)]
    rows = _Rows()
    mine = _overlap(held[rank], wanted[rank])
    rows.add(*mine, dy[:, mine[0] - held[rank][0]:mine[1] - held[rank][0]],
             weight[mine[0] - held[rank][0]:mine[1] - held[rank][0]])
    moves = [[_overlap(held[src], wanted[dst]) if src != dst else (0, 0) for dst in range(tp)] for src in range(tp)]
    if all(b == a for row in moves for a, b in row):
        return rows
    m = dy.shape[0]
    send_parts = [torch.cat([dy[:, a - held[rank][0]:b - held[rank][0]].t(), weight[a - held[rank][0]:b - held[rank][0]]],
                            dim=1) for a, b in moves[rank]]
    send = torch.cat(send_parts, dim=0).contiguous()
    in_sizes = [b - a for a, b in moves[rank]]
    out_sizes = [moves[src][rank][1] - moves[src][rank][0] for src in range(tp)]
    received = send.new_empty(sum(out_sizes), m + weight.shape[1])
    dist.all_to_all_single(received, send, out_sizes, in_sizes, group=group)
    offset = 0
    for src in range(tp):
        a, b = moves[src][rank]
        part = received[offset:offset + b - a]
        rows.add(a, b, part[:, :m].t(), part[:, m:])
        offset += b - a
    return rows


def lm_head_input_grad(dy: torch.Tensor, weight: torch.Tensor, group, vocab: int, shards: int, leaf_width: int,
                       out_dtype: torch.dtype, scatter: bool, row_multiple: int) -> torch.Tensor:
    """dx for dy (M, v_local) and this rank's LM-head rows ``weight`` (v_local, H), both in one dtype:
    the canonical tree over the whole vocab (module docstring), cast once; ``scatter``: this rank's
    slice of M (sequence parallel), else every row."""
    tp, rank = group_size(group), group_rank(group)
    if tp * weight.shape[0] < vocab:
        raise ValueError(f"LM-head gradient: {tp} ranks x {weight.shape[0]} rows hold less than the vocab {vocab}")
    rows = _exchange(dy, weight, vocab, shards, group) if tp > 1 else _Rows()
    if tp == 1:
        rows.add(0, vocab, dy, weight)
    per_shard = math.ceil(vocab / shards)
    slots = 1 << max(0, math.ceil(per_shard / leaf_width) - 1).bit_length()

    def leaves():
        for shard in range(rank * shards // tp, (rank + 1) * shards // tp):
            begin, end = shard * per_shard, min((shard + 1) * per_shard, vocab)
            for j in range(slots):
                lo, hi = begin + j * leaf_width, min(begin + (j + 1) * leaf_width, end)
                if lo >= hi:
                    yield None
                    continue
                dy_leaf, w_leaf = rows.take(lo, hi)
                yield invariant_matmul(dy_leaf, w_leaf, row_multiple)

    partial = fold_in_order(leaves(), slots * (shards // tp))
    if partial is None:  # no vocab row in this rank's shards: the empty subtree
        partial = torch.zeros(dy.shape[0], weight.shape[1], dtype=torch.float32, device=dy.device)
    return fold_across_ranks(partial, group, out_dtype, scatter_dim0=scatter)
