"""Worker (torchrun, 2 or 4 processes, vLLM installed): the engine's MoE across the ranks of an
expert tensor-and-model-parallel group (``numerics/vllm/expert_slices``) against one process
running every slice of every expert.

For each expert grid the world can hold (EP x ETP, positions numbered EP-major or ETP-major), dtype
(bf16, fp32) and engine TP (1, 2, 4): each rank holds its EP block of experts, its ETP part of their
intermediate, and its own tokens; its output must have the bits of the one-process output for its
tokens. Every prepacked slice is recorded (what a rank holds). Gradients (the plain fp32 math, not a
bitwise claim) against autograd of the one-process reference. Prints ``RESULT {json}`` on rank 0."""
import json

import torch
import torch.distributed as dist

from mindspeed_tp.check.driver import init_distributed
from mindspeed_tp.check.metrics import same_bits
from mindspeed_tp.numerics.vllm import expert_slices, kernels
from worker_exit import finish_worker

E, H, I, K, T = 8, 64, 128, 2, 12


def randn(*shape, seed, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def grids(world):
    out = []
    for ep in (d for d in (1, 2, 4) if world % d == 0):
        etp = world // ep
        out.append((ep, etp, "ep-major"))
        if ep > 1 and etp > 1:
            out.append((ep, etp, "etp-major"))
    return out


init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.new_group(list(range(world)))
recorded = []
prepack = kernels.prepack_slice
kernels.prepack_slice = lambda w13_r, w2_r, top_k: (recorded.append([list(w13_r.shape), list(w2_r.shape)]),
                                                     prepack(w13_r, w2_r, top_k))[1]
results = []
for ep, etp, order in grids(world):
    ep_rank, etp_rank = (rank // etp, rank % etp) if order == "ep-major" else (rank % ep, rank // ep)
    n_local, shard = E // ep, I // etp
    for dtype in (torch.bfloat16, torch.float32):
        for tp in (1, 2, 4):
            w13 = randn(E, 2 * I, H, seed=1, dtype=dtype, scale=0.1)
            w2 = randn(E, H, I, seed=2, dtype=dtype, scale=0.1)
            h = randn(world * T, H, seed=3, dtype=dtype)
            topk_w, topk_ids = kernels.route(randn(world * T, E, seed=4, dtype=dtype), K, True)
            packed, isa = kernels.prepack_experts(w13, w2, tp, K)
            want = kernels.add_engine_partials(kernels.fused_moe(h, topk_w, topk_ids, w13, w2, packed, isa),
                                               torch.float32, h.dtype)
            mine = slice(rank * T, (rank + 1) * T)
            own = slice(ep_rank * n_local, (ep_rank + 1) * n_local)
            cols = slice(etp_rank * shard, (etp_rank + 1) * shard)
            gate_up = torch.cat([w13[own, cols], w13[own, I + cols.start:I + cols.stop]], dim=1)
            w13_l = gate_up.clone().requires_grad_()
            w2_l = w2[own, :, cols].clone().requires_grad_()
            h_l = h[mine].clone().requires_grad_()
            del recorded[:]
            got = kernels.add_engine_partials(
                expert_slices.moe_across_ranks(h_l, topk_w[mine], topk_ids[mine], w13_l, w2_l, tp, K, group,
                                               ep_rank, etp_rank), torch.float32, dtype)
            go = randn(world * T, H, seed=5, dtype=torch.float32)
            got.float().backward(go[mine])
            ref_in = [t.detach().float().requires_grad_() for t in (h, w13, w2)]
            kernels._moe_reference(ref_in[0], topk_w, topk_ids, ref_in[1], ref_in[2]).backward(go)
            d13 = ref_in[1].grad
            want13 = torch.cat([d13[own, cols], d13[own, I + cols.start:I + cols.stop]], dim=1)
            tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
            grads_close = all(torch.allclose(a.float(), b, **tol) for a, b in (
                (h_l.grad, ref_in[0].grad[mine]), (w13_l.grad, want13), (w2_l.grad, ref_in[2].grad[own, :, cols])))
            flags = torch.tensor([int(same_bits(got, want[mine])), int(grads_close)])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            held = sum(a[0] * a[1] * a[2] + b[0] * b[1] * b[2] for a, b in recorded)
            results.append({"grid": f"ep{ep}-etp{etp}-{order}", "dtype": str(dtype), "tp": tp,
                            "bitwise": bool(flags[0]), "grads_close": bool(flags[1]), "slices": recorded[:],
                            "held_elements": held, "own_elements": 3 * n_local * shard * H})
if rank == 0:
    print("RESULT " + json.dumps(results), flush=True)
finish_worker()
