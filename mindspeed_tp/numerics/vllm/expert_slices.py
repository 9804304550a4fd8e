"""The engine's MoE across Megatron's expert group (EP x expert-TP ranks), without gathering every expert.

The engine at TP=R (no expert parallelism) holds the R-th part of every expert's intermediate on
each engine rank; its output for a token is the engine ranks' partials -- each one fused-MoE kernel
call over every expert's slice, the token's k experts summed in fp32 and cast once to the model
dtype -- added in rank order. A partial needs one slice of *every* expert in one kernel call, so the
work is cut by slice, not by expert: rank p of the expert group (W ranks) computes the slices
``assignment(W, R)[p]`` names, for its chunk of every rank's tokens. Each rank sends the parts of its
expert shards those slices contain (its EP block of experts, its expert-TP part of their
intermediate) to the ranks computing them, and its tokens' rows (with their routing); it gets back
the partials of its own tokens, in engine-rank order (the caller adds them as the engine does:
``kernels.add_engine_partials``). Every value is the kernel's on
the same rows (its rows do not depend on the other rows of the call), so the logprobs are the same
bits as on one rank.

Memory per rank: the slices it computes, of every expert -- R/W slices of 1/R each, its own shards'
size, when W divides R; at W > R one slice (W/R times its own shards' size: at an engine TP of 1 a
partial needs whole experts). The slices are exchanged and prepacked on every forward (nothing is
cached across forwards: a cache would hold them for the whole model). Backward: the plain fp32 math
per slice (``kernels.fused_moe``); the slices' gradients return to their shards' owners through the
reverse exchange.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from ...kernels.collectives import all_to_all_split, gather_along_rank, group_rank, group_size
from . import kernels


@dataclass(frozen=True)
class SliceWork:
    """What one rank of the expert group computes: engine slices ``slices``, on chunk ``chunk`` of
    ``chunks`` of every rank's tokens."""

    slices: Tuple[int, ...]
    chunk: int = 0
    chunks: int = 1


def assignment(world: int, rollout_tp: int) -> List[SliceWork]:
    """Per rank of the expert group (``world`` of them) its work for an engine of ``rollout_tp`` slices. W <= R: rank
    p computes the slices r with r % W == p, on every token; W > R: slice p % R on its share of the
    tokens (the ranks computing one slice cut every rank's tokens into that many chunks)."""
    if world <= rollout_tp:
        return [SliceWork(tuple(range(p, rollout_tp, world))) for p in range(world)]
    return [SliceWork((p % rollout_tp,), p // rollout_tp, len(range(p % rollout_tp, world, rollout_tp)))
            for p in range(world)]


def _chunk_rows(tokens: int, work: SliceWork) -> slice:
    return slice(tokens * work.chunk // work.chunks, tokens * (work.chunk + 1) // work.chunks)


def _chunk_len(tokens: int, work: SliceWork) -> int:
    rows = _chunk_rows(tokens, work)
    return rows.stop - rows.start


def _exchange(blocks: Sequence[Sequence[torch.Tensor]], recv_rows: Sequence[int], group):
    """Rows ``blocks[d]`` (a non-empty list of 2-D tensors, one row width) to each rank d; returns
    the rows received from each rank, split per source (differentiable for float rows)."""
    send = [sum(b.shape[0] for b in to_d) for to_d in blocks]
    rows = torch.cat([b for to_d in blocks for b in to_d])
    return list(all_to_all_split(rows, send, list(recv_rows), group).split(list(recv_rows)))


@dataclass(frozen=True)
class ExpertGrid:
    """Who holds what in the expert tensor-and-model-parallel group: per group position its EP rank
    (a block of E/EP experts, blocks in global expert order) and its expert-TP rank (the ETP-th
    part of each of those experts' intermediate, in order)."""

    ep_of: Tuple[int, ...]
    etp_of: Tuple[int, ...]

    @property
    def etp(self) -> int:
        return max(self.etp_of) + 1


def _pieces_of_slice(r: int, grid: ExpertGrid, rollout_tp: int):
    """Engine slice r as (position, its local piece index) per EP block, in expert and column order:
    pieces are I / max(R, ETP) intermediate columns wide; a position holds ``max(1, R/ETP)`` of them."""
    per_shard = max(1, rollout_tp // grid.etp)  # pieces a position's shard is cut into
    per_slice = max(1, grid.etp // rollout_tp)  # pieces one engine slice is made of
    out = []
    for block in range(max(grid.ep_of) + 1):
        for g in range(r * per_slice, (r + 1) * per_slice):
            q = next(q for q in range(len(grid.ep_of)) if grid.ep_of[q] == block and grid.etp_of[q] == g // per_shard)
            out.append((q, g % per_shard))
    return out


def _exchange_slices(w13: torch.Tensor, w2: torch.Tensor, work: List[SliceWork], me: int, rollout_tp: int,
                     grid: ExpertGrid, group) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """Every expert's slices this rank computes, {r: ((E, 2I/R, H) gate|up, (E, H, I/R) down)}
    (differentiable: their gradients go back to the shards' owners). One all-to-all pair per round
    (the i-th slice of every rank's work). Each position's shard is copied once, piece-major; a
    round sends views of that copy and, without expert TP, receives the slice itself (pieces in
    global expert order): no reassembly copy."""
    world = len(work)
    n_local, hidden, shard = w13.shape[0], w13.shape[-1], w2.shape[-1]
    per_shard = max(1, rollout_tp // grid.etp)
    width = shard // per_shard  # one piece's intermediate columns
    # Piece-major copies of my shards: j -> (E/EP, 2, width, H) gate|up and (E/EP, H, width).
    pieces13 = w13.reshape(n_local, 2, per_shard, width, hidden).permute(2, 0, 1, 3, 4).contiguous()
    pieces2 = w2.reshape(n_local, hidden, per_shard, width).permute(2, 0, 1, 3).contiguous()
    slices = {}
    for i in range(max(len(w.slices) for w in work)):
        wanted = [w.slices[i] if i < len(w.slices) else None for w in work]  # each rank's slice this round
        plans = [_pieces_of_slice(r, grid, rollout_tp) if r is not None else [] for r in wanted]
        mine_to = [[j for q, j in plan if q == me] for plan in plans]  # my pieces each rank needs, in order
        from_each = [[j for q, j in plans[me] if q == src] for src in range(world)]
        send13 = [len(js) * n_local * 2 * width for js in mine_to]
        recv13 = [len(js) * n_local * 2 * width for js in from_each]
        out13 = all_to_all_split(_rows(pieces13, [j for js in mine_to for j in js], hidden), send13, recv13, group)
        send2 = [len(js) * n_local * hidden for js in mine_to]
        recv2 = [len(js) * n_local * hidden for js in from_each]
        out2 = all_to_all_split(_rows(pieces2, [j for js in mine_to for j in js], width), send2, recv2, group)
        if wanted[me] is not None:
            slices[wanted[me]] = _assemble(out13, out2, plans[me], recv13, recv2, n_local, width, hidden,
                                           max(1, grid.etp // rollout_tp))
    return slices


def _rows(pieces: torch.Tensor, order: List[int], width: int) -> torch.Tensor:
    """The pieces ``order`` of a piece-major tensor as rows of ``width``: a view when they are a run
    of consecutive pieces (always without expert TP when EP divides the engine TP), else a copy."""
    if not order:
        return pieces[:0].reshape(-1, width)
    if order == list(range(order[0], order[0] + len(order))):
        return pieces[order[0]:order[0] + len(order)].reshape(-1, width)
    return pieces.index_select(0, torch.tensor(order, dtype=torch.long)).reshape(-1, width)


def _assemble(out13, out2, plan, recv13, recv2, n_local, width, hidden, per_block):
    """The received pieces (in source-position order, each source's in plan order) -> the slice,
    experts in global order and each expert's columns in order (``per_block`` pieces per expert)."""
    blocks = len(plan) // per_block
    sources = [q for q, _ in plan]
    if per_block == 1 and sources == sorted(sources):  # arrival order is the slice's: a view
        return out13.reshape(blocks * n_local, 2 * width, hidden), out2.reshape(blocks * n_local, hidden, width)
    got13, got2 = list(out13.split(recv13)), list(out2.split(recv2))
    taken = [0] * len(recv13)
    pieces13, pieces2 = [], []
    for q in sources:
        k = taken[q]
        taken[q] += 1
        pieces13.append(got13[q][k * n_local * 2 * width:(k + 1) * n_local * 2 * width].reshape(n_local, 2, width, hidden))
        pieces2.append(got2[q][k * n_local * hidden:(k + 1) * n_local * hidden].reshape(n_local, hidden, width))
    w13 = torch.cat([torch.cat(pieces13[b * per_block:(b + 1) * per_block], dim=2) for b in range(blocks)])
    w2 = torch.cat([torch.cat(pieces2[b * per_block:(b + 1) * per_block], dim=2) for b in range(blocks)])
    return w13.reshape(blocks * n_local, -1, hidden), w2


def moe_across_ranks(h: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, rollout_tp: int, top_k: int, group,
                     ep_rank: int, etp_rank: int = 0) -> List[torch.Tensor]:
    """The engine ranks' MoE partials (``kernels.add_engine_partials`` adds them) for this rank's
    tokens ``h`` (T, H), routed (``topk_w`` fp32,
    ``topk_ids`` int32 global expert ids, (T, k)), with this rank's expert shards ``w13``
    (E/EP, 2I/ETP, H) gate|up and ``w2`` (E/EP, H, I/ETP): the experts of EP block ``ep_rank``,
    intermediate part ``etp_rank``. ``group``: the expert tensor-and-model-parallel group."""
    world, me = group_size(group), group_rank(group)
    work = assignment(world, rollout_tp)
    table = gather_along_rank(torch.tensor([h.shape[0], ep_rank, etp_rank], dtype=torch.long), group).tolist()
    tokens = [t for t, _, _ in table]
    grid = ExpertGrid(tuple(e for _, e, _ in table), tuple(a for _, _, a in table))
    if len(set(zip(grid.ep_of, grid.etp_of))) != world:
        raise ValueError(f"expert group positions must hold distinct (EP, ETP) shards, got {table}")

    slices = _exchange_slices(w13, w2, work, me, rollout_tp, grid, group)

    # Tokens: my chunk for rank d's work -> rank d, with their routing.
    chunks = [_chunk_rows(h.shape[0], work[d]) for d in range(world)]
    recv = [_chunk_len(tokens[q], work[me]) for q in range(world)]
    x = torch.cat(_exchange([[h[c]] for c in chunks], recv, group))
    w = torch.cat(_exchange([[topk_w[c]] for c in chunks], recv, group))
    ids = torch.cat(_exchange([[topk_ids[c]] for c in chunks], recv, group))

    # My slices' partials of those tokens (model dtype), each back to its tokens' rank.
    partials = {}
    for r in work[me].slices:
        (packed, isa) = kernels.prepack_slice(*slices[r], top_k)
        (partials[r],) = kernels.fused_moe(x, w, ids, slices[r][0], slices[r][1], [packed], isa)
    back = [[partials[r][sum(recv[:q]):sum(recv[:q + 1])] for r in work[me].slices] for q in range(world)]
    mine_rows = [_chunk_len(h.shape[0], work[d]) for d in range(world)]
    got = _exchange(back, [n * len(work[d].slices) for d, n in enumerate(mine_rows)], group)

    # Each slice's partial of my tokens: its chunks from the ranks computing it, in row order.
    per_slice = {r: [] for r in range(rollout_tp)}
    for d in range(world):
        for i, r in enumerate(work[d].slices):
            per_slice[r].append((work[d].chunk, got[d][i * mine_rows[d]:(i + 1) * mine_rows[d]]))
    return [torch.cat([rows for _, rows in sorted(per_slice[r], key=lambda c: c[0])]) for r in range(rollout_tp)]
