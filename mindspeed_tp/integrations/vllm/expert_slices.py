"""The engine's MoE across Megatron's expert-parallel ranks, without gathering every expert.

The engine at TP=R (no expert parallelism) holds the R-th part of every expert's intermediate on
each engine rank; its output for a token is the engine ranks' partials -- each one fused-MoE kernel
call over every expert's slice, the token's k experts summed in fp32 and cast once to the model
dtype -- added in rank order. A partial needs one slice of *every* expert in one kernel call, so the
work is cut by slice, not by expert: EP rank p computes the slices ``assignment(W, R)[p]`` names,
for its chunk of every EP rank's tokens. Each rank sends the slices of its own experts to the ranks
computing them, and its tokens' rows (with their routing); it gets back the partials of its own
tokens and adds them in engine-rank order. Every value is the kernel's on the same rows (its rows do
not depend on the other rows of the call), so the logprobs are the same bits as on one rank.

Memory per rank: the slices it computes, of every expert -- R/W slices of 1/R each, its own experts'
size, when W divides R; at W > R one slice (W/R times its own experts' size: at an engine TP of 1 a
partial needs whole experts). The slices are exchanged and prepacked on every forward (nothing is
cached across forwards: a cache would hold them for the whole model). Backward: the plain fp32 math
per slice (``kernels.fused_moe``); the slices' gradients return to their experts' owners through the
reverse exchange.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ...kernels.collectives import all_to_all_split, gather_along_rank, group_rank, group_size
from . import kernels


@dataclass(frozen=True)
class SliceWork:
    """What one EP rank computes: engine slices ``slices``, on chunk ``chunk`` of ``chunks`` of every
    EP rank's tokens."""

    slices: Tuple[int, ...]
    chunk: int = 0
    chunks: int = 1


def assignment(world: int, rollout_tp: int) -> List[SliceWork]:
    """Per EP rank (``world`` of them) its work for an engine of ``rollout_tp`` slices. W <= R: rank
    p computes the slices r with r % W == p, on every token; W > R: slice p % R on its share of the
    tokens (the ranks computing one slice cut every rank's tokens into that many chunks)."""
    if world <= rollout_tp:
        return [SliceWork(tuple(range(p, rollout_tp, world))) for p in range(world)]
    return [SliceWork((p % rollout_tp,), p // rollout_tp, len(range(p % rollout_tp, world, rollout_tp)))
            for p in range(world)]


def _chunk_rows(tokens: int, work: SliceWork) -> slice:
    return slice(tokens * work.chunk // work.chunks, tokens * (work.chunk + 1) // work.chunks)


def _exchange(blocks: Sequence[Sequence[torch.Tensor]], recv_rows: Sequence[int], group, like: torch.Tensor):
    """Rows ``blocks[d]`` (a list of 2-D tensors, one row width) to each rank d; returns the rows
    received from each rank, split per source (differentiable)."""
    send = [sum(b.shape[0] for b in to_d) for to_d in blocks]
    parts = [b for to_d in blocks for b in to_d]
    rows = torch.cat(parts) if parts else like.new_empty((0, like.shape[-1]))
    return list(all_to_all_split(rows, send, list(recv_rows), group).split(list(recv_rows)))


def _exchange_ids(blocks: Sequence[torch.Tensor], recv_rows: Sequence[int], group) -> List[torch.Tensor]:
    """Integer rows (not differentiable) to each rank d, split per source on arrival."""
    send = [b.shape[0] for b in blocks]
    rows = torch.cat(list(blocks)).contiguous()
    out = rows.new_empty((sum(recv_rows), rows.shape[-1]))
    dist.all_to_all_single(out, rows, list(recv_rows), send, group=group)
    return list(out.split(list(recv_rows)))


def _rows(by_slice: torch.Tensor, order: List[int], width: int) -> torch.Tensor:
    """The slices ``order`` of a slice-major tensor as rows of ``width``: a view when they are a
    run of consecutive slices (EP dividing the engine TP), else a copy."""
    if order == list(range(order[0], order[0] + len(order))):
        return by_slice[order[0]:order[0] + len(order)].reshape(-1, width)
    return by_slice.index_select(0, torch.tensor(order, dtype=torch.long)).reshape(-1, width)


def _exchange_slices(w13: torch.Tensor, w2: torch.Tensor, work: List[SliceWork], me: int, rollout_tp: int,
                     group) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """Every expert's slices this rank computes, {r: ((E, 2I/R, H) gate|up, (E, H, I/R) down)}
    (differentiable: their gradients go back to the experts' owners). One all-to-all pair per round
    (the i-th slice of every rank's work); a round's output, in source-rank order, is the slice
    itself with experts in global order: no reassembly copy."""
    world = len(work)
    n_local, hidden, inter = w13.shape[0], w13.shape[-1], w2.shape[-1]
    part = inter // rollout_tp
    # Slice-major copies of my experts (one copy each): r -> (E/W, 2*part, H) gate_r|up_r and (E/W, H, part).
    by_slice13 = w13.reshape(n_local, 2, rollout_tp, part, hidden).permute(2, 0, 1, 3, 4).contiguous()
    by_slice2 = w2.reshape(n_local, hidden, rollout_tp, part).permute(2, 0, 1, 3).contiguous()
    rows13, rows2 = n_local * 2 * part, n_local * hidden  # one slice of my experts, as rows of H and part
    slices = {}
    for i in range(max(len(w.slices) for w in work)):
        wanted = [w.slices[i] if i < len(w.slices) else None for w in work]  # each rank's slice this round
        send = [rows13 if r is not None else 0 for r in wanted]
        recv = [rows13 if wanted[me] is not None else 0] * world
        order = [r for r in wanted if r is not None]
        out13 = all_to_all_split(_rows(by_slice13, order, hidden), send, recv, group)
        send2 = [rows2 if r is not None else 0 for r in wanted]
        recv2 = [rows2 if wanted[me] is not None else 0] * world
        out2 = all_to_all_split(_rows(by_slice2, order, part), send2, recv2, group)
        if wanted[me] is not None:
            slices[wanted[me]] = (out13.reshape(world * n_local, 2 * part, hidden),
                                  out2.reshape(world * n_local, hidden, part))
    return slices


def moe_across_ranks(h: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, rollout_tp: int, top_k: int, add_dtype: torch.dtype, group) -> torch.Tensor:
    """The engine's MoE output for this rank's tokens ``h`` (T, H), routed (``topk_w`` fp32,
    ``topk_ids`` int32 global expert ids, (T, k)), with this rank's experts ``w13`` (E/W, 2I, H) and
    ``w2`` (E/W, H, I): global experts [p*E/W, (p+1)*E/W) on EP rank p of ``group``."""
    world, me = group_size(group), group_rank(group)
    work = assignment(world, rollout_tp)
    tokens = gather_along_rank(torch.tensor([h.shape[0]], dtype=torch.long), group).reshape(-1).tolist()

    slices = _exchange_slices(w13, w2, work, me, rollout_tp, group)

    # Tokens: my chunk for rank d's work -> rank d, with their routing.
    chunks = [_chunk_rows(h.shape[0], work[d]) for d in range(world)]
    recv = [len(range(*_chunk_rows(tokens[q], work[me]).indices(tokens[q]))) for q in range(world)]
    x = torch.cat(_exchange([[h[c]] for c in chunks], recv, group, h))
    w = torch.cat(_exchange([[topk_w[c]] for c in chunks], recv, group, topk_w))
    ids = torch.cat(_exchange_ids([topk_ids[c] for c in chunks], recv, group))

    # My slices' partials of those tokens (model dtype), each back to its tokens' rank.
    partials = {}
    for r in work[me].slices:
        (packed, isa) = kernels.prepack_slice(*slices[r], top_k)
        partials[r] = kernels.fused_moe(x, w, ids, slices[r][0], slices[r][1], [packed], isa, add_dtype)
    back = [[partials[r][sum(recv[:q]):sum(recv[:q + 1])] for r in work[me].slices] for q in range(world)]
    mine_rows = [len(range(*chunks[d].indices(h.shape[0]))) for d in range(world)]
    got = _exchange(back, [n * len(work[d].slices) for d, n in enumerate(mine_rows)], group, h)

    # Each slice's partial of my tokens: its chunks from the ranks computing it, in row order.
    per_slice = {r: [] for r in range(rollout_tp)}
    for d in range(world):
        for i, r in enumerate(work[d].slices):
            per_slice[r].append((work[d].chunk, got[d][i * mine_rows[d]:(i + 1) * mine_rows[d]]))
    total = None
    for r in range(rollout_tp):  # engine-rank order, as the engine's all-reduce adds
        part = torch.cat([rows for _, rows in sorted(per_slice[r], key=lambda c: c[0])])
        total = part if total is None else total.to(add_dtype) + part.to(add_dtype)
    return total.to(h.dtype)
