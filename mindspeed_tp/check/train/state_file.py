"""A layout-free training state: every parameter's full logical tensor (TP=1 names and shapes), its
fp32 main copy and Adam's two moments, plus the step count, in one safetensors file.

``save_state`` gathers each rank's TP shards (moved, never summed) and brings every stage's tensors
to rank 0, which writes the file; ``load_state`` gives every rank its shard of each tensor (the
model parameter, the optimizer's main parameter -- a DP rank's range of it under the distributed
optimizer -- and Adam's state). A job saved in one layout and resumed in another continues the same
trajectory under bitwise training (tests/test_bitwise_training.py::test_resharding_mid_run).
Dense models only (expert shards live on other groups).
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ...errors import ConfigError
from ...kernels.collectives import gather_along_rank
from ...models.weights import full_weight_shapes, param_shards, shard, unshard
from .snapshots import leaf_optimizers, main_param_pairs, optimizer_states

KINDS = ("param", "main_param", "exp_avg", "exp_avg_sq")


def _full_on_this_stage(spec, layout, chunks, optimizer) -> Dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    states = optimizer_states(optimizer, chunks)
    tp_group = ps.get_tensor_model_parallel_group()
    out = {}
    for chunk in chunks:
        for name, p, rule, size, _ in param_shards(chunk, spec, layout):
            values = {"param": p.detach().float(), **{k: states[p][k] for k in KINDS[1:]}}
            for kind, value in values.items():
                parts = gather_along_rank(value.contiguous(), tp_group) if size > 1 else value.unsqueeze(0)
                out[f"{kind}/{name}"] = unshard(list(parts), rule)
    return out


def save_state(path: str, spec, layout, profile, chunks, optimizer, steps_done: int) -> None:
    if spec.is_moe:
        raise ConfigError("--save-state: dense models only (expert shards are not gathered)")
    mine = _full_on_this_stage(spec, layout, chunks, optimizer)
    shapes = full_weight_shapes(spec, spec.padded_vocab(profile))
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in sorted(n for n in shapes if not n.endswith("expert_bias")):
        for kind in KINDS:
            key = f"{kind}/{name}"
            holder = torch.tensor([rank if key in mine else world])
            dist.all_reduce(holder, op=dist.ReduceOp.MIN)
            if int(holder) == world:
                raise RuntimeError(f"--save-state: no rank holds {key}")
            t = mine[key].contiguous() if key in mine else torch.empty(shapes[name], dtype=torch.float32)
            dist.broadcast(t, src=int(holder))
            out[key] = t
    if rank == 0:
        save_file(out, path, metadata={"steps": str(steps_done), "model": spec.name})
    dist.barrier()


def load_state(path: str, spec, layout, chunks, optimizer) -> int:
    """Put this rank's shards of the saved state in place; returns the saved step count."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        steps = int((f.metadata() or {}).get("steps", "0"))
    full = load_file(path)
    by_param = {}
    for chunk in chunks:
        for name, p, rule, size, rank in param_shards(chunk, spec, layout):
            if f"param/{name}" not in full:
                raise ConfigError(f"--load-state {path}: no tensor for {name} (saved from another model?)")
            by_param[p] = {kind: shard(full[f"{kind}/{name}"], rule, size, rank) for kind in KINDS}
            with torch.no_grad():
                p.copy_(by_param[p]["param"].to(p.dtype))
    for opt in leaf_optimizers(optimizer):
        sharded = hasattr(opt, "shard_fp32_from_float16_groups")
        for model_param, main in main_param_pairs(opt):
            values = by_param[model_param]
            rng = opt._get_model_param_range_map(model_param)["param"] if sharded else None

            def pick(t, r=rng):  # this rank's range of the flattened parameter (all of it unsharded)
                return t.reshape(-1) if r is None else t.reshape(-1)[r.start:r.end]

            with torch.no_grad():
                main.view(-1).copy_(pick(values["main_param"]).to(main.dtype))
            opt.optimizer.state[main] = {
                "step": torch.tensor(float(steps)),
                "exp_avg": pick(values["exp_avg"]).clone().view(main.shape).to(main.device),
                "exp_avg_sq": pick(values["exp_avg_sq"]).clone().view(main.shape).to(main.device),
            }
    return steps
