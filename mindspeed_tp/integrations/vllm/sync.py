"""Weight sync in memory, as RL frameworks do it: the training model's shards gathered to full
tensors, mapped to Hugging Face names, handed to the running engine's ``load_weights`` (through
``Engine.load_weights``); no checkpoint on disk.

Collective over the model's tensor-parallel (and, for MoE, expert-parallel) group; pipeline
parallelism is refused (each stage would send its own layers: not implemented here).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ...contract.refusals import refuse
from ...models.spec import ModelSpec
from ...models.weights import global_param_name, is_expert_weight, shard_rule, unshard
from .checkpoint import hf_tensors_from_full


def _gather_tp(param: torch.Tensor, rule: str, group) -> torch.Tensor:
    from ...kernels.collectives import group_size

    world = group_size(group)
    if world == 1 or rule == "replicated":
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(world)]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return unshard(parts, rule)


def gathered_full_weights(model, spec: ModelSpec, layout) -> Dict[str, torch.Tensor]:
    """Megatron TP=1 tensors (global names) of a model in ``layout``, on every rank."""
    if layout.pp > 1:
        raise refuse("vllm_sync_source", what="a pipeline-parallel model", fix="pp=1")
    return stage_full_weights(model, spec, layout)


def stage_full_weights(model, spec: ModelSpec, layout) -> Dict[str, torch.Tensor]:
    """The full (TP- and EP-gathered) tensors of the layers this model chunk holds, by global name, on
    every rank of its tensor- and expert-parallel groups (one pipeline stage's share; ``check.rl``
    brings the stages together)."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    ep_rank = ps.get_expert_model_parallel_rank() if spec.is_moe else 0
    full: Dict[str, torch.Tensor] = {}
    experts: List[Tuple[str, torch.Tensor]] = []
    for local_name, param in model.named_parameters():
        name = global_param_name(model, local_name, ep_rank)
        if is_expert_weight(name):  # whole experts from the expert-TP shards, then gathered over EP below
            experts.append((local_name, _gather_tp(param, shard_rule(name), ps.get_expert_tensor_parallel_group())))
            continue
        full[name] = _gather_tp(param, shard_rule(name), tp_group)
    if experts:
        ep_group = ps.get_expert_model_parallel_group()
        from ...kernels.collectives import group_size

        world = group_size(ep_group)
        for local_name, tensor in experts:
            parts = [torch.empty_like(tensor) for _ in range(world)] if world > 1 else [tensor]
            if world > 1:
                dist.all_gather(parts, tensor.contiguous(), group=ep_group)
            for rank, part in enumerate(parts):  # EP rank r holds the same local slot of its own experts
                full[global_param_name(model, local_name, rank)] = part
    return full


def hf_weights(model, spec: ModelSpec, layout, padded_vocab: int):
    """(HF name, tensor) pairs of the training model, for ``Engine.load_weights``."""
    return list(hf_tensors_from_full(gathered_full_weights(model, spec, layout), spec, padded_vocab))
