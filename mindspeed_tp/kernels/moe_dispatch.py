"""Selected-row MoE dispatch over the expert tensor-and-model-parallel group.

Each token slot (token t, slot j, expert e) goes only to the ranks holding expert e (its EP rank's
expert-TP ranks), by one all-to-all with split sizes; its output comes back from one of them (the
owner: the lowest group position holding that EP rank) by the reverse all-to-all. Per rank and
layer that is T*k rows out and T*k rows back (times the expert-TP size going out), against the
W*T*k rows of a dense slot tensor.

The order is the one the dense path had, so every value is the same bits: an expert sees its rows
ordered by (source group position, token, slot), i.e. the order of the rows of the tokens
all-gathered over the group; a token's k outputs land in slot order for the fp32 slot-order
combine (``kernels/moe.py``).

The split sizes are the slot counts per (rank, local expert), exchanged once per layer (W x
experts-per-rank integers, as megatron's alltoall dispatcher exchanges its tokens per expert): one
small host read per layer, no per-expert host syncs, and no per-row metadata on the wire (a
rank's rows go out sorted by (destination, local expert, token, slot), so the receiver reorders
them from the counts alone).
"""
from dataclasses import dataclass
from typing import List

import torch

from .collectives import all_to_all_slots, all_to_all_split, group_size


@dataclass
class DispatchPlan:
    """Where every token slot goes and comes back from, for one rank of the group."""

    send_tokens: torch.Tensor  # (sum(send),) the token row sent, in send order
    send: List[int]            # rows sent to each group position
    recv: List[int]            # rows received from each group position
    expert_rows: torch.Tensor  # (sum(recv),) received row of each expert-ordered row
    expert_counts: List[int]   # rows of each local expert (expert-ordered rows, in that order)
    to_received: torch.Tensor  # (sum(recv),) expert-ordered row of each received row
    back_send: List[int]       # output rows returned to each group position
    back_recv: List[int]       # output rows returned by each group position
    restore: torch.Tensor      # (T*k,) returned row of each (token, slot), slot-major within a token
    recv_blocks: List[List[int]]  # rows received from each group position for each local expert


def _stable_order(keys: torch.Tensor) -> torch.Tensor:
    return torch.sort(keys, stable=True).indices


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _block_transpose(counts: List[List[int]], device) -> torch.Tensor:
    """Rows laid out in blocks (a, b) of counts[a][b] rows, a-major -> the row order b-major
    (blocks (b, a), each block's rows kept in order)."""
    flat = [c for row in counts for c in row]
    starts, total = [], 0
    for c in flat:
        starts.append(total)
        total += c
    rows_a, rows_b = len(counts), len(counts[0]) if counts else 0
    order = [a * rows_b + b for b in range(rows_b) for a in range(rows_a)]
    sizes = torch.tensor([flat[i] for i in order], dtype=torch.long, device=device)
    begin = torch.tensor([starts[i] for i in order], dtype=torch.long, device=device)
    out_begin = torch.cumsum(sizes, 0) - sizes
    first = torch.repeat_interleave(begin - out_begin, sizes, output_size=total)
    return first + torch.arange(total, device=device)


def plan(idx: torch.Tensor, ep_of_position: torch.Tensor, position: int, num_experts: int, num_local: int,
         group) -> DispatchPlan:
    """idx (T, k): this rank's routing; ep_of_position (W,): the EP rank of each group position;
    position: this rank's. Exchanges the slot counts per (rank, local expert) with the group."""
    tokens, k = idx.shape
    nk = tokens * k
    world = ep_of_position.numel()
    num_ep = num_experts // num_local
    device = idx.device
    hist = torch.bincount(idx.reshape(-1), minlength=num_experts)  # this rank's slots per expert
    # Rows this rank sends to each position, per local expert there; the same from every position.
    to_each = hist.view(num_ep, num_local)[ep_of_position.long()]  # (W, num_local)
    from_each = to_each if group_size(group) == 1 else all_to_all_slots(to_each, group).reshape(world, num_local)
    # The one host read of the layer: the group's layout and slot counts.
    host = torch.cat([ep_of_position.reshape(-1).long(), to_each.reshape(-1), from_each.reshape(-1)]).tolist()
    ep_h = host[:world]
    send_blocks = [host[world + p * num_local: world + (p + 1) * num_local] for p in range(world)]
    base = world + world * num_local
    recv_blocks = [host[base + s * num_local: base + (s + 1) * num_local] for s in range(world)]
    positions = [[p for p in range(world) if ep_h[p] == e] for e in range(num_ep)]
    if len({len(p) for p in positions}) != 1 or not positions[0]:
        raise ValueError(f"every EP rank must appear equally often in the expert group, got EP ranks {ep_h}")
    owner = [p[0] for p in positions]
    mine = ep_h[position]

    send = [sum(b) for b in send_blocks]
    recv = [sum(b) for b in recv_blocks]
    expert_counts = [sum(recv_blocks[s][j] for s in range(world)) for j in range(num_local)]
    back_send = recv if owner[mine] == position else [0] * world
    back_recv = [send[p] if owner[ep_h[p]] == p else 0 for p in range(world)]

    flat = idx.reshape(nk)
    my_ep = torch.div(flat, num_local, rounding_mode="floor")
    local = flat % num_local
    # Each slot goes to every position holding its EP rank (copy c to the c-th such position),
    # ordered by (destination, local expert, token, slot).
    table = torch.tensor(positions, dtype=torch.long, device=device)  # (num_ep, expert-TP)
    keys = (table[my_ep] * num_local + local.unsqueeze(1)).t().reshape(-1)
    send_tokens = torch.div(_stable_order(keys) % nk, k, rounding_mode="floor")
    # Received rows: blocks (source position, local expert), each in (token, slot) order. Expert
    # order: (local expert, source position, token, slot) -- the dense path's order over the
    # all-gathered rows.
    expert_rows = _block_transpose(recv_blocks, device)
    # Returned rows: by owner position, then (local expert, token, slot).
    owners = torch.tensor(owner, dtype=torch.long, device=device)
    restore = _inverse(_stable_order(owners[my_ep] * num_local + local))
    return DispatchPlan(send_tokens, send, recv, expert_rows, expert_counts, _inverse(expert_rows), back_send,
                        back_recv, restore, recv_blocks)


def dispatch(h: torch.Tensor, p: DispatchPlan, group) -> List[torch.Tensor]:
    """Token rows h (T, H) -> each local expert's input rows (differentiable)."""
    received = all_to_all_split(h.index_select(0, p.send_tokens), p.send, p.recv, group)
    return list(received.index_select(0, p.expert_rows).split(p.expert_counts))


def combine(outputs: List[torch.Tensor], p: DispatchPlan, group, tokens: int, k: int) -> torch.Tensor:
    """The local experts' outputs (in ``dispatch``'s order) -> (T, k, H): each of this rank's
    token slots' expert output, from its owner (differentiable)."""
    out = torch.cat(outputs).index_select(0, p.to_received)
    back = all_to_all_split(out, p.back_send, p.back_recv, group)
    return back.index_select(0, p.restore).reshape(tokens, k, -1)
