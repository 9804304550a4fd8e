"""What a training step produced, per parameter, as this rank's full TP shard of each tensor.

- ``reduced_main_grads``: the gradients the optimizer steps on (megatron DDP's ``main_grad`` after
  the data-parallel reduction). With the distributed optimizer a rank's buffer holds only its own
  reduced shard of each bucket; the other shards are moved in (an all-gather of a copy), never summed.
- ``optimizer_states``: Adam's ``exp_avg``, ``exp_avg_sq`` and the fp32 main parameter, by model
  parameter. With the distributed optimizer each DP rank owns a range of each parameter; the ranges
  are assembled by a sum over DP of zero-filled copies (every element comes from one rank, the others
  add +0: exact).

``ShardComparison`` compares these (and the parameters) with the one-device run's full tensors,
shard by shard with ``torch.equal``, and names the parameters that differ.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist

from ..models.weights import param_shards, shard

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


def _leaf_optimizers(optimizer) -> Iterable:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield opt


def _pairs(opt) -> Iterable[Tuple[torch.nn.Parameter, torch.nn.Parameter]]:
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


def optimizer_states(optimizer) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    out = {}
    for opt in _leaf_optimizers(optimizer):
        sharded = hasattr(opt, "shard_fp32_from_float16_groups")
        for model_param, main in _pairs(opt):
            state = opt.optimizer.state.get(main, {})
            values = {"exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq"), "main_param": main}
            if not sharded:
                out[model_param] = {k: v.detach().float().clone().view(model_param.shape)
                                    for k, v in values.items() if v is not None}
                continue
            rng = opt._get_model_param_range_map(model_param)["param"]
            full = {}
            for key in OPTIMIZER_STATE_KEYS:
                t = torch.zeros(model_param.numel(), dtype=torch.float32, device=main.device)
                if values[key] is not None:
                    t[rng.start:rng.end] = values[key].detach().float().view(-1)
                full[key] = t
            stacked = torch.stack([full[k] for k in OPTIMIZER_STATE_KEYS])
            group = opt.data_parallel_group if getattr(opt, "data_parallel_group", None) is not None \
                else ps.get_data_parallel_group()
            if group.size() > 1:
                dist.all_reduce(stacked, group=group)
            out[model_param] = {k: stacked[i].view(model_param.shape) for i, k in enumerate(OPTIMIZER_STATE_KEYS)}
    return out


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
        """(max |diff| over every rank, sorted names whose shard is not torch.equal on some rank)."""
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
            if not torch.equal(mine, part.float()):
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
