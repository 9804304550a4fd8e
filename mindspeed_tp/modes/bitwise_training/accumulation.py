"""Gradient accumulation over micro-batches and DP ranks in canonical order.

Vanilla Megatron adds each micro-batch's gradient into ``main_grad`` as it comes (a chain over the
rank's micro-batches), then sums the DP ranks' chains in the collective: the order depends on how
many micro-batches each rank holds. Here the global batch's micro-batches are ``G =
microbatch_groups`` contiguous groups: inside a group a chain in micro-batch order (into
``main_grad``, as vanilla), the groups folded by a perfect binary tree in index order. A DP rank
holds G/DP consecutive groups, a subtree: it keeps each finished group's sum (an fp32 copy; a
binary counter keeps at most log2(G/DP) of them) and folds them before the DP reduction, whose
single level for DP=2 is one addition of two values, the same whoever adds.

The backward hook (``count_microbatch``) runs before Megatron's own hook adds the micro-batch's
gradient; ``fold_groups`` runs when a bucket group starts its gradient sync (after the last
micro-batch, with or without overlap_grad_reduce).
"""
from typing import Dict, List, Tuple

import torch

from ...contract.refusals import refuse
from ...errors import ConfigError

# Set per forward_backward call by the schedule wrapper: micro-batches per group on this rank.
_plan: Dict[str, int] = {}
_counts: Dict[int, int] = {}
_stacks: Dict[int, List[Tuple[int, torch.Tensor]]] = {}
HOOKED_ATTR = "_mindspeed_tp_bitwise_hook"


def set_schedule(num_microbatches: int, dp: int, groups: int) -> None:
    """Validate and record one step's micro-batch plan (called by the schedule wrapper)."""
    total = num_microbatches * dp
    if dp > 2 or groups % dp or total % groups or total & (total - 1):
        raise refuse("bitwise_microbatch_groups", microbatches=num_microbatches, dp=dp, groups=groups)
    _plan.update(per_group=total // groups, local=num_microbatches)


def count_microbatch(param: torch.nn.Parameter) -> None:
    """Before the hook adds this micro-batch's gradient: at a group boundary, set the finished
    group's sum aside (tree-folded with the earlier ones) and start the next chain from zero."""
    key = id(param)
    seen = _counts.get(key, 0)
    per_group = _plan.get("per_group")
    if per_group is None:
        raise ConfigError("bitwise_training: a backward pass ran outside megatron's forward_backward_func (the "
                          "micro-batch plan is unknown); run training steps through get_forward_backward_func()")
    if seen and seen % per_group == 0:
        _push(key, param.main_grad.detach().clone())
        param.main_grad.zero_()
    _counts[key] = seen + 1


def _push(key: int, tensor: torch.Tensor) -> None:
    stack = _stacks.setdefault(key, [])
    node, size = tensor, 1
    while stack and stack[-1][0] == size:
        node, size = stack.pop()[1] + node, size * 2  # left (earlier groups) + right
    stack.append((size, node))


def fold_groups(params) -> None:
    """Fold the set-aside group sums with the last chain into main_grad (before the DP reduction)."""
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
        stack = _stacks.pop(key, [])
        if not stack:
            continue
        _push(key, param.main_grad.detach().clone())
        stack = _stacks.pop(key)
        if len(stack) != 1:
            raise RuntimeError("bitwise_training: micro-batch groups per rank are not a power of two")
        param.main_grad.copy_(stack[0][1])


def reset() -> None:
    _counts.clear()
    _stacks.clear()
