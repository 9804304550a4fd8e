"""Gradient accumulation over micro-batches and DP ranks in canonical order.

Vanilla Megatron adds each micro-batch's gradient into ``main_grad`` as it comes (a chain over the
rank's micro-batches), then sums the DP ranks' chains in the collective: the order depends on how
many micro-batches each rank holds. The canonical order here:

- micro-batch ``j`` of the global batch is its j-th chunk of micro_batch_size sequences in sampler
  order; as Megatron's pretraining sampler deals them, DP rank r's k-th micro-batch is j = k*DP + r;
- ``G = microbatch_groups`` groups, micro-batch j in group j mod G; inside a group a chain in j
  order (vanilla's accumulation into ``main_grad``);
- the groups folded by a perfect binary tree whose leaves are the groups in bit-reversed index
  order. A DP rank's groups (those = r mod DP) are then one subtree: it folds them before the DP
  reduction, whose single level for DP=2 is one addition of two values, the same whoever adds.

A rank holding several groups keeps each group's chain while another is being accumulated (an fp32
copy per extra group: G/DP - 1 of them). The backward hook (``count_microbatch``) runs before
Megatron's own hook adds the micro-batch's gradient; ``fold_groups`` runs when a bucket group starts
its gradient sync (after the last micro-batch, with or without overlap_grad_reduce).
"""
from typing import Dict

import torch

from ...contract.refusals import refuse
from ...contract.tree import tree_fold
from ...errors import ConfigError

# Set per forward_backward call by the schedule wrapper.
_plan: Dict[str, int] = {}
_counts: Dict[int, int] = {}
_chains: Dict[int, Dict[int, torch.Tensor]] = {}
HOOKED_ATTR = "_mindspeed_tp_bitwise_hook"


def set_schedule(num_microbatches: int, dp: int, dp_rank: int, groups: int) -> None:
    """Validate and record one step's micro-batch plan (called by the schedule wrapper)."""
    total = num_microbatches * dp
    if dp > 2 or groups % dp or total % groups or total & (total - 1):
        raise refuse("bitwise_microbatch_groups", microbatches=num_microbatches, dp=dp, groups=groups)
    _plan.update(local=num_microbatches, dp=dp, dp_rank=dp_rank, groups=groups)


def _group(k: int) -> int:
    """The group of this rank's k-th micro-batch."""
    return (k * _plan["dp"] + _plan["dp_rank"]) % _plan["groups"]


def _bit_reversed(g: int, groups: int) -> int:
    bits = groups.bit_length() - 1
    return int(format(g, f"0{bits}b")[::-1], 2) if bits else 0


def count_microbatch(param: torch.nn.Parameter) -> None:
    """Before the hook adds micro-batch k's gradient: if it belongs to another group than k-1,
    set the previous group's chain aside and continue this group's (or start it from zero)."""
    if not _plan:
        raise ConfigError("bitwise_training: a backward pass ran outside megatron's forward_backward_func (the "
                          "micro-batch plan is unknown); run training steps through get_forward_backward_func()")
    key = id(param)
    k = _counts.get(key, 0)
    _counts[key] = k + 1
    if k == 0 or _group(k) == _group(k - 1):
        return
    chains = _chains.setdefault(key, {})
    chains[_group(k - 1)] = param.main_grad.detach().clone()
    resumed = chains.pop(_group(k), None)
    if resumed is None:
        param.main_grad.zero_()
    else:
        param.main_grad.copy_(resumed)


def fold_groups(params) -> None:
    """Fold this rank's group chains into main_grad by the tree (before the DP reduction)."""
    for param in params:
        if not getattr(param, HOOKED_ATTR, False):
            raise ConfigError("bitwise_training: this DistributedDataParallel was built before mindspeed-tp was "
                              "enabled with bitwise_training, so its gradient hooks are megatron's own; enable first, "
                              "then build the model and DDP")
        key = id(param)
        seen = _counts.pop(key, 0)
        if seen and seen != _plan.get("local"):
            raise RuntimeError(f"bitwise_training: a parameter received {seen} micro-batch gradients, the schedule "
                               f"ran {_plan.get('local')}; every parameter must be used by every micro-batch")
        chains = _chains.pop(key, None)
        if not chains:
            continue
        chains[_group(seen - 1)] = param.main_grad.detach().clone()
        order = sorted(chains, key=lambda g: _bit_reversed(g, _plan["groups"]))
        param.main_grad.copy_(tree_fold(torch.stack([chains[g] for g in order]), dim=0))


def reset() -> None:
    _counts.clear()
    _chains.clear()
