"""MoE routing and combine, row-local and layout-independent.

Router scores in fp32; top-k in descending score order with ties broken by the lower expert id;
normalisation and the weighted combine summed over the k slots in slot order, in fp32.
"""
from typing import Optional, Tuple

import torch

from . import dispatch, elementwise


def _slot_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (the k slots) left to right: ((s0 + s1) + s2) + ..."""
    total = x[..., 0]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j]
    return total


def slot_sum_fp32(slots: torch.Tensor) -> torch.Tensor:
    """(T, k, H) -> (T, H): a token's k slot rows summed in slot order, in fp32."""
    return _slot_sum(slots.float().movedim(1, -1))


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax in fp32 (the backend's ``softmax`` primitive)."""
    return dispatch.kernel("softmax", x)(x)


def topk_lowest_id_on_ties(scores: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, descending; equal scores keep ascending expert id."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def group_limited(select: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """``select`` (T, E) with the experts outside each token's ``group_topk`` best groups at -inf
    (Megatron's group_limited_topk): the E experts in ``num_groups`` contiguous groups, a group
    scored by the sum of its top ``topk // group_topk`` scores (descending, summed in that order),
    ties between groups and experts broken by the lower id."""
    tokens, experts = select.shape
    per_group = experts // num_groups
    best, _ = topk_lowest_id_on_ties(select.reshape(tokens, num_groups, per_group), topk // group_topk)
    _, groups = topk_lowest_id_on_ties(_slot_sum(best), group_topk)
    keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=select.device).scatter_(1, groups, True)
    return select.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))


def route(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    expert_bias: Optional[torch.Tensor] = None,
    scaling_factor: Optional[float] = None,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts and their weights per token.

    logits: (T, E), any float dtype (computed in fp32). Returns (indices (T, k) long in slot
    order, probs (T, k) fp32). Semantics follow Megatron's router: softmax with pre_softmax=False
    normalises over the k chosen logits; sigmoid selects on score + expert_bias and normalises the
    unbiased scores of the chosen experts when k > 1; with ``group_topk`` (and ``num_groups``) the
    selection is limited to each token's best groups (``group_limited``), as megatron's.
    """
    logits = logits.float()

    def select_topk(scores):
        if group_topk:
            scores = group_limited(scores, topk, num_groups, group_topk)
        return topk_lowest_id_on_ties(scores, topk)

    if score_function == "softmax":
        if pre_softmax:
            scores = _softmax(logits)
            probs, idx = select_topk(scores)
        else:
            chosen, idx = select_topk(logits)
            e = elementwise.exp(chosen - chosen[..., :1])  # slot 0 holds the max
            probs = e / _slot_sum(e).unsqueeze(-1)
    elif score_function == "sigmoid":
        scores = elementwise.sigmoid(logits)
        select = scores if expert_bias is None else scores + expert_bias.float()
        _, idx = select_topk(select)
        probs = scores.gather(-1, idx)
        if topk > 1:
            probs = probs / (_slot_sum(probs).unsqueeze(-1) + 1e-20)
    else:
        raise ValueError(f"unsupported router score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    return idx, probs


class _ZeroSignedGrad(torch.autograd.Function):
    """Identity; backward adds +0.0 to the gradient (-0.0 becomes +0.0, every other value stays).
    ``combine_slots`` reads its k slots by ``unbind``, whose backward stacks the k slot gradients
    into one tensor; indexing each slot (``x[:, j]``) made autograd build k zero tensors of the
    whole (T, k, H) and add them, so each gradient element was its slot's value plus k - 1 zeros:
    the same value with -0.0 turned +0.0, which this keeps."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad + 0.0


def combine_slots(expert_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """sum_j probs[t, j] * expert_out[t, j] in fp32, slot order. expert_out: (T, k, H)."""
    if torch.is_grad_enabled() and expert_out.requires_grad:
        expert_out = _ZeroSignedGrad.apply(expert_out)
    slots = expert_out.unbind(1)
    acc = probs[:, 0:1].float() * slots[0].float()
    for j in range(1, len(slots)):
        acc = acc + probs[:, j : j + 1].float() * slots[j].float()
    return acc
