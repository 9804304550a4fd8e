"""Worker (torchrun, 4 processes, gloo): the selected-row MoE dispatch (kernels/moe_dispatch.py)
against the dense slot path it replaced (every rank's slots for the whole group in one (W*T, k, H)
tensor, all-to-all'd, the owner's copy selected), on a small case per group layout (expert-TP 1
and 2, the EP ranks in blocks and interleaved). Records per layout: both results, the elements each
rank sent to other ranks by the dispatch (token rows out, expert outputs back) and by the dense
path, and that backward ran. Saved by
rank 0 (every rank's numbers)."""
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from mindspeed_tp.kernels import moe_dispatch
from mindspeed_tp.kernels.collectives import all_to_all_rows, gather_along_rank
from worker_exit import finish_worker

dist.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()
GROUP = dist.new_group(list(range(WORLD)))
TOKENS, K, H, NUM_EXPERTS = 6, 3, 5, 8
# EP rank of each group position.
LAYOUTS = {"ep4": [0, 1, 2, 3], "ep2-etp2-blocks": [0, 0, 1, 1], "ep2-etp2-interleaved": [0, 1, 0, 1]}

SENT = {"elements": 0}
_original = dist.all_to_all_single


def _counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    rows = input.shape[0]
    splits = input_split_sizes or [rows // WORLD] * WORLD
    row = input[0].numel() if rows else 0
    SENT["elements"] += sum(n for r, n in enumerate(splits) if r != RANK) * row
    return _original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


dist.all_to_all_single = _counting


def expert(e, x):
    """A row-local stand-in for an expert MLP (its value depends on the expert and the row only)."""
    return (x.float() * (e + 1) + e).sin().to(x.dtype)


def routing(seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:K] for _ in range(TOKENS)])
    return h, idx


def dense(h, idx, ep_of_position, num_local):
    """The path the dispatch replaced."""
    h_all = gather_along_rank(h, GROUP).reshape(-1, H)
    idx_all = gather_along_rank(idx, GROUP).reshape(-1, K)
    me = ep_of_position[RANK]
    slots = torch.zeros(h_all.shape[0], K, H, dtype=h.dtype)
    for j in range(num_local):
        rows, slot = torch.nonzero(idx_all == me * num_local + j, as_tuple=True)
        slots = slots.index_put((rows, slot), expert(me * num_local + j, h_all.index_select(0, rows)))
    received = all_to_all_rows(slots, GROUP).reshape(WORLD, TOKENS, K, H)
    owner = torch.tensor([ep_of_position.index(e) for e in range(max(ep_of_position) + 1)])[idx // num_local]
    tokens = torch.arange(TOKENS).unsqueeze(1).expand(TOKENS, K)
    return received[owner, tokens, torch.arange(K).expand(TOKENS, K)]


def selected(h, idx, ep_of_position, num_local):
    me = ep_of_position[RANK]
    h = h.clone().requires_grad_(True)
    plan = moe_dispatch.plan(idx, torch.tensor(ep_of_position), RANK, NUM_EXPERTS, num_local, GROUP)
    SENT["elements"] = 0
    inputs = moe_dispatch.dispatch(h, plan, GROUP)
    dispatched = SENT["elements"]
    outputs = [expert(me * num_local + j, x) for j, x in enumerate(inputs)]
    SENT["elements"] = 0
    out = moe_dispatch.combine(outputs, plan, GROUP, TOKENS, K)
    returned = SENT["elements"]
    out.float().sum().backward()
    return out.detach(), h.grad, dispatched, returned


result = {}
for name, ep_of_position in LAYOUTS.items():
    num_local = NUM_EXPERTS // (max(ep_of_position) + 1)
    h, idx = routing(100 + RANK)
    ours, grad, dispatched, returned = selected(h, idx, ep_of_position, num_local)
    SENT["elements"] = 0
    with torch.no_grad():
        theirs = dense(h, idx, ep_of_position, num_local)
    dense_sent = SENT["elements"]
    numbers = torch.tensor([dispatched, returned, dense_sent, int(grad is not None and grad.shape == h.shape)])
    gathered = gather_along_rank(numbers, GROUP)
    outs = gather_along_rank(torch.stack([ours, theirs]).view(torch.int16).int(), GROUP)
    result[f"{name}/sent"] = gathered
    result[f"{name}/outputs"] = outs
result["shape"] = torch.tensor([TOKENS, K, H, WORLD])
if RANK == 0:
    save_file(result, sys.argv[1])
finish_worker()
