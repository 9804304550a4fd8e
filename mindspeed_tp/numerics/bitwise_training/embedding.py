"""The word embedding's weight gradient under bitwise training, where autograd's dense backward
(each token's output-gradient row added, in token order, into a zero [V/TP, H] tensor) is not enough:

- context parallelism: a CP rank holds two chunks of each sequence, and the gradient must be the
  whole micro-batch's on every CP rank: the ids and output gradients are gathered over CP in
  sequence order (moved, nothing added: ``context_parallel.py``), then the same backward runs;
- an embedding tied to the LM head on one stage (PP=1, ``TIED_HEAD_ATTR``): on a pipeline the two
  gradients of the shared weight are accumulated on two stages, DP-reduced apart and added once
  (megatron's embedding-group all-reduce); on one stage vanilla adds them in backward order. Here
  the LM head's gradient takes the parameter's own path (main_grad, the micro-batch groups, the
  bucket's DP reduction) and the embedding's is kept apart as rows (``accumulation.add_embedding_rows``):
  it is nonzero only at the step's token ids, so it costs the step's distinct ids x H, not a second
  fp32 copy of the vocabulary shard (622 MB per rank at Qwen3-1.7B, TP 2) and its DP reduction.

The backward runs the module's own op (``F.embedding``, or ``weight[ids]`` in megatron's
deterministic mode) on a zero weight of the distinct ids only: a row's additions are the dense
backward's (its tokens in token order from +0.0; the CPU kernels add a row's tokens serially,
whatever other rows exist), checked against a pipeline stage's dense backward by the tied layouts
of tests/test_bitwise_training.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...models.marks import TIED_HEAD_ATTR
from . import accumulation
from .context_parallel import cp_group, gather_rows


def _lookup(ids: torch.Tensor, weight: torch.Tensor, by_index: bool) -> torch.Tensor:
    return weight[ids] if by_index else F.embedding(ids, weight)


def distinct_rows_grad(ids: torch.Tensor, grad: torch.Tensor, dtype, by_index: bool):
    """(the distinct ids, sorted; their rows of the embedding's weight gradient) for output gradient
    ``grad`` [*ids.shape, H]: the dense backward's rows, computed on a weight of those rows alone."""
    rows, inverse = torch.unique(ids, return_inverse=True)
    with torch.enable_grad():
        compact = torch.zeros((rows.numel(), grad.shape[-1]), dtype=dtype, device=grad.device, requires_grad=True)
        (dw,) = torch.autograd.grad(_lookup(inverse, compact, by_index), [compact], grad.to(dtype))
    return rows, dw


class _EmbeddingLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` (or ``weight[ids]``); backward: under CP the whole micro-batch's
    ids and output gradient (all-gathered in sequence order along dim 1), the gradient by distinct
    rows; a tied weight's rows go to its accumulator (the weight gets no gradient from here), an
    untied one's are spread into the dense gradient (+0.0 elsewhere, as the dense backward's)."""

    @staticmethod
    def forward(ctx, ids, weight, group, tied, by_index):
        ctx.group, ctx.tied, ctx.by_index, ctx.param = group, tied, by_index, weight
        ctx.save_for_backward(ids)
        return _lookup(ids, weight, by_index)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight = ctx.param
        if ctx.group is not None:
            ids, grad = gather_rows(ids.contiguous(), ctx.group, dim=1), gather_rows(grad.contiguous(), ctx.group, dim=1)
        rows, dw = distinct_rows_grad(ids, grad, weight.dtype, ctx.by_index)
        if ctx.tied:
            accumulation.add_embedding_rows(weight, rows, dw)
            return None, None, None, None, None
        return None, torch.zeros_like(weight).index_copy_(0, rows, dw), None, None, None


class _LookupWeight:
    """Stands in for the embedding weight during one forward: ``weight[ids]`` (megatron's
    deterministic mode) and ``F.embedding(ids, weight)`` both reach ``_EmbeddingLookup``."""

    def __init__(self, weight, group, tied):
        self.weight, self.group, self.tied = weight, group, tied

    def __getitem__(self, ids):
        return _EmbeddingLookup.apply(ids, self.weight, self.group, self.tied, True)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            ids = args[0] if args else kwargs["input"]
            return _EmbeddingLookup.apply(ids, self.weight, self.group, self.tied, False)
        raise TypeError(f"bitwise_training: the embedding weight used by {func}, not by its lookup")


def lookup_forward(module, input_, original):
    """megatron's VocabParallelEmbedding.forward (``original``) with, under CP or with a tied weight on
    this stage, the weight's gradient by ``_EmbeddingLookup`` (the patch entry: ``patches.py``)."""
    group, tied = cp_group(), getattr(module.weight, TIED_HEAD_ATTR, False)
    if group is None and not tied:
        return original(module, input_)
    # An instance attribute shadows the registered parameter for this call only: the module's own
    # masking and TP reduction run around the lookup.
    object.__setattr__(module, "weight", _LookupWeight(module.weight, group, tied))
    try:
        return original(module, input_)
    finally:
        object.__delattr__(module, "weight")
