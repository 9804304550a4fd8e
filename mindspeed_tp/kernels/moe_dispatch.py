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

The split sizes follow from the routing of the whole group (all-gathered once per layer, k
integers per token): one small host read per layer, as megatron's alltoall dispatcher does, and no
per-expert host syncs.
"""
from dataclasses import dataclass
from typing import List

import torch

from .collectives import all_to_all_split


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


def _stable_order(keys: torch.Tensor) -> torch.Tensor:
    return torch.sort(keys, stable=True).indices


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def plan(idx: torch.Tensor, idx_all: torch.Tensor, ep_of_position: torch.Tensor, position: int,
         num_experts: int, num_local: int) -> DispatchPlan:
    """idx (T, k): this rank's routing; idx_all (W, T, k): every group position's, in position
    order; ep_of_position (W,): the EP rank of each position; position: this rank's."""
    world, tokens, k = idx_all.shape
    nk = tokens * k
    num_ep = num_experts // num_local
    flat_all = idx_all.reshape(world, nk)
    ep_all = torch.div(flat_all, num_local, rounding_mode="floor")
    per_ep = torch.zeros(world, num_ep, dtype=torch.long, device=idx.device)
    per_ep.scatter_add_(1, ep_all, torch.ones_like(ep_all))
    per_expert = torch.bincount(flat_all.reshape(-1), minlength=num_experts)
    # The one host read of the layer: the group's layout and slot counts.
    host = torch.cat([ep_of_position.reshape(-1).long(), per_ep.reshape(-1), per_expert.long()]).tolist()
    ep_h = host[:world]
    counts = [host[world + s * num_ep: world + (s + 1) * num_ep] for s in range(world)]
    hist = host[world + world * num_ep:]
    positions = [[p for p in range(world) if ep_h[p] == e] for e in range(num_ep)]
    if len({len(p) for p in positions}) != 1 or not positions[0]:
        raise ValueError(f"every EP rank must appear equally often in the expert group, got EP ranks {ep_h}")
    owner = [p[0] for p in positions]
    mine = ep_h[position]

    send = [counts[position][ep_h[p]] for p in range(world)]
    recv = [counts[s][mine] for s in range(world)]
    expert_counts = hist[mine * num_local:(mine + 1) * num_local]
    back_send = recv if owner[mine] == position else [0] * world
    back_recv = [send[p] if owner[ep_h[p]] == p else 0 for p in range(world)]

    device = idx.device
    my_ep = torch.div(idx.reshape(nk), num_local, rounding_mode="floor")
    # Each slot goes to every position holding its EP rank (copy c to the c-th such position);
    # stable by destination: within one destination, (token, slot) order.
    table = torch.tensor(positions, dtype=torch.long, device=device)  # (num_ep, expert-TP)
    order = _stable_order(table[my_ep].t().reshape(-1))
    send_tokens = torch.div(order % nk, k, rounding_mode="floor")
    # Received rows: by source position, then (token, slot). Expert order: (local expert, source
    # position, token, slot) -- the dense path's order over the all-gathered rows.
    selected = (ep_all == mine).reshape(-1)
    local = torch.where(selected, flat_all.reshape(-1) % num_local, torch.full_like(flat_all.reshape(-1), num_local))
    by_expert = _stable_order(local)[:sum(recv)]
    expert_rows = (torch.cumsum(selected.long(), 0) - 1)[by_expert]
    # Returned rows: by owner position, then (token, slot).
    owners = torch.tensor(owner, dtype=torch.long, device=device)
    restore = _inverse(_stable_order(owners[my_ep]))
    return DispatchPlan(send_tokens, send, recv, expert_rows, expert_counts, _inverse(expert_rows), back_send,
                        back_recv, restore)


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
