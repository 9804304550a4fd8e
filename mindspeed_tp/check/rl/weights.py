"""The full weights of a model trained in any layout, by global (TP=1) name, for the engine.

Each pipeline stage gathers its layers' TP and EP shards (moved, never summed:
``integrations.vllm.sync.stage_full_weights``); then every tensor goes from the lowest rank holding
it to every rank by a broadcast, so rank 0 (the engine's host) has them all."""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from ...integrations.vllm.sync import stage_full_weights
from ...models.weights import full_weight_shapes, global_param_name


def full_parameters(spec, layout, profile, chunks) -> Dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    mine: Dict[str, torch.Tensor] = {}
    for chunk in chunks:
        mine.update(stage_full_weights(chunk, spec, layout))
        ep_rank = ps.get_expert_model_parallel_rank() if spec.is_moe else 0
        for local_name, buf in chunk.named_buffers():  # the routers' expert bias (replicated)
            if local_name.endswith("router.expert_bias"):
                mine[global_param_name(chunk, local_name, ep_rank)] = buf.detach()
    shapes = full_weight_shapes(spec, spec.padded_vocab(profile))
    dtype = next(iter(mine.values())).dtype
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in sorted(shapes):
        holder = torch.tensor([rank if name in mine else world])
        dist.all_reduce(holder, op=dist.ReduceOp.MIN)
        if int(holder) == world:
            raise RuntimeError(f"rl-check: no rank holds {name}")
        want = mine[name].dtype if name in mine else (torch.float32 if name.endswith("expert_bias") else dtype)
        kind = torch.tensor([0 if want == dtype else 1])
        dist.broadcast(kind, src=int(holder))
        t = (mine[name].detach().contiguous().cpu() if name in mine
             else torch.empty(shapes[name], dtype=dtype if int(kind) == 0 else torch.float32))
        dist.broadcast(t, src=int(holder))
        out[name] = t
    return out
