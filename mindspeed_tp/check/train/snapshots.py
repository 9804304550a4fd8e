"""What a training step produced, per parameter, as this rank's full TP shard of each tensor.

- ``reduced_main_grads``: the gradients the optimizer steps on (megatron DDP's ``main_grad`` after
  the data-parallel reduction). With the distributed optimizer a rank's buffer holds only its own
  reduced shard of each bucket; the other shards are moved in (an all-gather of a copy), never summed.
- ``optimizer_states``: Adam's ``exp_avg``, ``exp_avg_sq`` and the fp32 main parameter, by model
  parameter. With the distributed optimizer each DP rank owns a range of each parameter; the ranges
  are assembled by a sum over DP of zero-filled copies (every element comes from one rank, the others
  add +0: exact).

``ShardComparison`` compares these (and the parameters) with the one-device run's full tensors,
shard by shard by their raw bits (``check.metrics.same_bits``: -0.0 and +0.0 differ), and names the
parameters that differ.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist

from ...models.weights import param_shards, shard
from ..metrics import same_bits

OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "main_param")


def _buffers(ddp) -> List:
    return list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))


def reduced_main_grads(wrapped) -> Dict[torch.nn.Parameter, torch.Tensor]:
    out = {}
    for ddp in wrapped:
        sharded = ddp.ddp_config.use_distributed_optimizer
        for buffer in _buffers(ddp):
            full = buffer.grad_data.detach().clone()
            group = buffer.data_parallel_group
            dp = group.size()
            if sharded and dp > 1:
                for bucket in buffer.buckets:
                    view = full[bucket.offset: bucket.offset + bucket.grad_data.numel()]
                    mine = view.view(dp, -1)[group.rank()].clone()
                    dist.all_gather_into_tensor(view, mine, group=group)
            for param, (start, end, _) in buffer.param_index_map.items():
                out[param] = full[start:end].view(param.shape)
    return out


def leaf_optimizers(optimizer) -> Iterable:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield opt


def main_param_pairs(opt) -> Iterable[Tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(model parameter, the tensor the inner torch optimizer steps) for every parameter."""
    if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer: shards of main params
        for models, shards in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                               (opt.model_fp32_groups, opt.shard_fp32_groups)):
            for mg, sg in zip(models, shards):
                yield from zip(mg, sg)
    elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        for mg, sg in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            yield from zip(mg, sg)
        for g in opt.fp32_from_fp32_groups:
            yield from ((p, p) for p in g)
    else:  # FP32Optimizer
        for group in opt.optimizer.param_groups:
            yield from ((p, p) for p in group["params"])


def optimizer_states(optimizer, chunks) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    local, sharded = {}, False
    for opt in leaf_optimizers(optimizer):
        for model_param, main in main_param_pairs(opt):
            state = opt.optimizer.state.get(main, {})
            values = {"exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq"), "main_param": main}
            if hasattr(opt, "shard_fp32_from_float16_groups"):
                sharded = True
                rng = opt._get_model_param_range_map(model_param)["param"]
                local[model_param] = (rng, values)
            else:
                local[model_param] = (None, values)
    params = [p for chunk in chunks for p in chunk.parameters()]  # the same order on every DP rank
    if not sharded:
        return {p: {k: v.detach().float().clone().view(p.shape) for k, v in local[p][1].items() if v is not None}
                for p in params if p in local}
    # Each DP rank owns a range of some parameters: zero-filled full copies, one sum over DP (exact:
    # every element comes from one rank, the others add +0). Expert weights of expert-parallel
    # buffers are sharded over the expert-data-parallel group instead.
    out = {}
    expert = [p for p in params if not getattr(p, "allreduce", True)]
    dense = [p for p in params if getattr(p, "allreduce", True)]
    for members, group in ((dense, ps.get_data_parallel_group(with_context_parallel=True)),
                           (expert, ps.get_expert_data_parallel_group() if expert else None)):
        out.update(_sum_shards(members, local, group))
    return {p: out[p] for p in params}


def _sum_shards(params, local, group) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
    flat = torch.zeros(len(OPTIMIZER_STATE_KEYS), sum(p.numel() for p in params), dtype=torch.float32)
    offset, where = 0, {}
    for p in params:
        where[p] = offset
        if p in local:
            rng, values = local[p]
            for i, key in enumerate(OPTIMIZER_STATE_KEYS):
                if values[key] is not None:
                    flat[i, offset + rng.start: offset + rng.end] = values[key].detach().float().view(-1).cpu()
        offset += p.numel()
    if params and dist.get_world_size(group=group) > 1:
        dist.all_reduce(flat, group=group)
    return {p: {k: flat[i, where[p]: where[p] + p.numel()].view(p.shape) for i, k in enumerate(OPTIMIZER_STATE_KEYS)}
            for p in params}


class ShardComparison:
    """This rank's tensors by global parameter name vs the one-device run's full tensors."""

    def __init__(self, spec, layout, chunks):
        self.spec, self.layout, self.chunks = spec, layout, chunks

    def _shards(self):
        for chunk in self.chunks:
            yield from param_shards(chunk, self.spec, self.layout)

    def snapshot(self, values: Dict[torch.nn.Parameter, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Full tensors by global name (the one-device run: every shard is the full tensor)."""
        return {name: values[p].detach().float().cpu().clone() for name, p, _, _, _ in self._shards() if p in values}

    def compare(self, values: Dict[torch.nn.Parameter, torch.Tensor], reference: Dict[str, torch.Tensor]):
        """(max |diff| over every rank, sorted names whose shard differs in its raw bits on some rank:
        -0.0 and +0.0 differ)."""
        worst = torch.zeros(1, dtype=torch.float64)
        names = []
        order = sorted(reference)
        differs = torch.zeros(len(order), dtype=torch.int64)
        seen = torch.zeros(len(order), dtype=torch.int64)
        for name, p, rule, size, rank in self._shards():
            if p not in values:
                continue
            part = shard(reference[name], rule, size, rank)
            mine = values[p].detach().float().cpu()
            if part.shape != mine.shape:
                raise RuntimeError(f"train-check: {name} of shape {tuple(mine.shape)} is no shard of the reference "
                                   f"{tuple(reference[name].shape)}")
            i = order.index(name)
            seen[i] = 1
            if not same_bits(mine, part):
                differs[i] = 1
                worst = torch.maximum(worst, (mine.double() - part.double()).abs().max().reshape(1))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        missing = [order[i] for i in range(len(order)) if not seen[i]]
        if missing:
            raise RuntimeError(f"train-check: no rank holds {missing[:3]}... of the reference")
        names = [order[i] for i in range(len(order)) if differs[i]]
        return float(worst), names


def params_of(chunks) -> Dict[torch.nn.Parameter, torch.Tensor]:
    return {p: p for chunk in chunks for p in chunk.parameters()}


def state_values(states, key: str) -> Dict[torch.nn.Parameter, torch.Tensor]:
    return {p: s[key] for p, s in states.items() if key in s}
