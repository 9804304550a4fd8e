"""Per-token log-probabilities over a (possibly vocab-parallel) logits tensor, fp32 throughout.

The sum of exp over the vocab is cut into C canonical leaves of V/C columns (V padded
TP-independently); each rank folds its C/TP leaves, the per-rank results are gathered and folded in
rank order. The max and the target logit are exact operations and need no ordering.
"""
from typing import Optional

import torch

from . import dispatch
from .collectives import group_size, gather_along_rank, group_rank, max_across_ranks
from ..contract.refusals import refuse
from ..contract.tree import tree_fold


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, vocab_start: int = 0) -> torch.Tensor:
    """Set the columns of TP-independent vocab padding (ids >= vocab_size) to -inf: exact, so
    padding never changes a logprob. ``vocab_start``: the global id of this shard's first column."""
    v_local = logits.shape[-1]
    if vocab_start + v_local <= vocab_size:
        return logits
    cols = torch.arange(vocab_start, vocab_start + v_local, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, float("-inf"))


def _leaf_sums(e: torch.Tensor) -> torch.Tensor:
    """Sum of each vocab leaf (last dim), in the backend's fixed per-row order."""
    return dispatch.kernel("row_sum", e)(e)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, canonical_shards, vocab_size, temperature):
        world = group_size(group)
        v_local = logits.shape[-1]
        if canonical_shards % world:
            raise refuse("tp_not_power_of_two_dividing_c", setting="tensor_model_parallel_size", tp=world,
                         c=canonical_shards)
        leaves = canonical_shards // world
        if v_local % leaves:
            raise refuse("vocab_indivisible", v=v_local * world, c=canonical_shards)
        vocab_start = group_rank(group) * v_local
        lf = logits.float()
        if temperature != 1.0:
            lf = lf / temperature
        if vocab_size is not None:
            lf = mask_padded_vocab(lf, vocab_size, vocab_start)
        lmax = max_across_ranks(lf.amax(-1), group)
        e = torch.exp(lf - lmax.unsqueeze(-1))
        local = tree_fold(_leaf_sums(e.reshape(*e.shape[:-1], leaves, v_local // leaves)), dim=-1)
        total = tree_fold(gather_along_rank(local, group), dim=0)
        in_range = (target >= vocab_start) & (target < vocab_start + v_local)
        idx = (target - vocab_start).clamp(0, v_local - 1).long()
        picked = torch.where(in_range, lf.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
        target_logit = tree_fold(gather_along_rank(picked, group), dim=0)
        logprob = (target_logit - lmax) - torch.log(total)
        ctx.save_for_backward(e, total, in_range, idx)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        return logprob

    @staticmethod
    def backward(ctx, grad):
        e, total, in_range, idx = ctx.saved_tensors
        g = -(e / total.unsqueeze(-1)) * grad.unsqueeze(-1)
        g.scatter_add_(-1, idx.unsqueeze(-1), torch.where(in_range, grad, 0.0).unsqueeze(-1))
        if ctx.temperature != 1.0:
            g = g / ctx.temperature
        return g.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_logprob(
    logits: torch.Tensor,
    target: torch.Tensor,
    group=None,
    canonical_shards: int = 8,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log softmax(logits / T)[target] in fp32; ``logits`` holds this rank's vocab shard.

    vocab_size: the true vocab; padded columns at or beyond it are excluded exactly.
    """
    return _VocabParallelLogprob.apply(logits, target, group, canonical_shards, vocab_size, temperature)
