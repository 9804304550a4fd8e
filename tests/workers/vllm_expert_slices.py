"""Worker (torchrun, 2 processes, vLLM installed): the engine's MoE across two EP ranks
(``integrations/vllm/expert_slices``) against one process running every slice of every expert.

Per dtype (bf16, fp32) and engine TP (1: W > R, 2: W = R, 4: W < R): each rank holds half the
experts and half the tokens; its output must have the bits of the one-process output for its tokens.
Every prepacked slice is recorded: its experts and intermediate width, to show what a rank holds.
Gradients (the plain fp32 math, not a bitwise claim) against autograd of the one-process reference.
Prints ``RESULT {json}`` on rank 0."""
import json

import torch
import torch.distributed as dist

from mindspeed_tp.check.harness import init_distributed
from mindspeed_tp.check.metrics import same_bits
from mindspeed_tp.integrations.vllm import expert_slices, kernels
from worker_exit import finish_worker

E, H, I, K, T = 8, 64, 128, 2, 12


def randn(*shape, seed, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.new_group(list(range(world)))
n_local = E // world
recorded = []
prepack = kernels.prepack_slice
kernels.prepack_slice = lambda w13_r, w2_r, top_k: (recorded.append([list(w13_r.shape), list(w2_r.shape)]),
                                                     prepack(w13_r, w2_r, top_k))[1]
results = []
for dtype in (torch.bfloat16, torch.float32):
    for tp in (1, 2, 4):
        w13 = randn(E, 2 * I, H, seed=1, dtype=dtype, scale=0.1)
        w2 = randn(E, H, I, seed=2, dtype=dtype, scale=0.1)
        h = randn(world * T, H, seed=3, dtype=dtype)
        topk_w, topk_ids = kernels.route(randn(world * T, E, seed=4, dtype=dtype), K, True)
        packed, isa = kernels.prepack_experts(w13, w2, tp, K)
        want = kernels.fused_moe(h, topk_w, topk_ids, w13, w2, packed, isa, torch.float32)
        mine = slice(rank * T, (rank + 1) * T)
        own = slice(rank * n_local, (rank + 1) * n_local)
        w13_l = w13[own].clone().requires_grad_()
        w2_l = w2[own].clone().requires_grad_()
        h_l = h[mine].clone().requires_grad_()
        del recorded[:]
        got = expert_slices.moe_across_ranks(h_l, topk_w[mine], topk_ids[mine], w13_l, w2_l, tp, K, torch.float32,
                                             group)
        go = randn(world * T, H, seed=5, dtype=torch.float32)
        got.float().backward(go[mine])
        ref_in = [t.detach().float().requires_grad_() for t in (h, w13, w2)]
        ref = kernels._moe_reference(ref_in[0], topk_w, topk_ids, ref_in[1], ref_in[2])
        ref.backward(go)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        grads_close = all(torch.allclose(a.float(), b.grad[s], **tol)
                          for a, b, s in ((h_l.grad, ref_in[0], mine), (w13_l.grad, ref_in[1], own),
                                          (w2_l.grad, ref_in[2], own)))
        flags = torch.tensor([int(same_bits(got, want[mine])), int(grads_close)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        held = sum(a[0] * a[1] * a[2] + b[0] * b[1] * b[2] for a, b in recorded)
        results.append({"dtype": str(dtype), "tp": tp, "bitwise": bool(flags[0]), "grads_close": bool(flags[1]),
                        "slices": recorded[:], "held_elements": held, "own_elements": 3 * n_local * I * H})
if rank == 0:
    print("RESULT " + json.dumps(results), flush=True)
finish_worker()
