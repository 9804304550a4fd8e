"""Per-token log-probabilities over a (possibly vocab-parallel) logits tensor, fp32 throughout.

The sum of exp over the vocab is cut into leaves of L contiguous columns, L chosen from the true
vocab size alone (``vocab_leaf_width``), never from how the vocab is padded or split: padded columns
are excluded (exp = 0 exactly), every rank sums its whole leaves (each the same L columns in every
layout) and folds its run's aligned blocks of leaves (subtrees), the block sums are gathered and
merged by one perfect binary tree over the true vocab's leaves, zero-padded to a power of two (adding
an exact zero changes nothing). So the
bits are the same for any TP and any padding (Megatron's ``make_vocab_size_divisible_by`` x TP, the
profile's TP-independent padding, or none). The max and the target logit are exact operations.
"""
from typing import Optional

import torch

from . import dispatch, elementwise
from .collectives import group_size, gather_along_rank, group_rank, max_across_ranks
from .sampling import divide_by_temperature
from ..contract.refusals import refuse
from ..contract.tree import dyadic_blocks, merge_blocks, tree_fold


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


def _power_of_two_part(n: int) -> int:
    return n & -n


def vocab_leaf_width(vocab_size: int, canonical_shards: int = 8, pad_multiple: int = 128) -> int:
    """Columns per canonical vocab leaf for a true vocab of ``vocab_size``: the largest power of two
    that divides every rank's shard in the layouts megatron can build -- padded to a multiple of
    ``pad_multiple`` x TP (megatron's make_vocab_size_divisible_by, or the profile's padding), or
    unpadded and split by TP | C (then it must also divide vocab_size / C)."""
    width = _power_of_two_part(pad_multiple)
    if vocab_size % canonical_shards == 0:
        width = min(width, _power_of_two_part(vocab_size // canonical_shards))
    return width


def _fold_vocab_leaves(local: torch.Tensor, group, used: int) -> torch.Tensor:
    """The perfect tree over the ``used`` leaves that hold a real column (the rest sum to exactly 0:
    empty subtrees), every rank holding a contiguous run of ``local.shape[-1]`` leaves in rank order.
    Each rank folds its run's maximal aligned blocks (subtrees) itself and only the block sums are
    gathered -- about 2 log2(leaves) numbers per token and rank instead of every leaf sum -- then the
    blocks merge bottom-up in tree order: the same additions as folding every leaf at once."""
    world, n = group_size(group), local.shape[-1]
    runs = [dyadic_blocks(min(r * n, used), min((r + 1) * n, used)) for r in range(world)]
    most = max(1, max(len(blocks) for blocks in runs))
    me = group_rank(group)
    sums = [tree_fold(local[..., a - me * n:a - me * n + size], dim=-1) for a, size in runs[me]]
    sums += [local.new_zeros(local.shape[:-1])] * (most - len(sums))
    gathered = gather_along_rank(torch.stack(sums, dim=-1), group)  # (world, ..., most)
    return merge_blocks({block: gathered[r, ..., i] for r in range(world) for i, block in enumerate(runs[r])})


# Elements of exp(logits - max) alive at once in the forward: the (tokens, V/TP) exponentials never
# exist whole beside the logits (at vocab 151936, 8k tokens, TP 2: 2.3 GiB each); the backward
# recomputes them from the logits it saves, as megatron's cross entropy keeps one such buffer.
EXP_CHUNK_ELEMENTS = 1 << 24


def _shifted_exp(lf: torch.Tensor, lmax: torch.Tensor, real: int) -> torch.Tensor:
    """exp(lf - lmax) per row, the padded columns (>= ``real``) exactly 0: elementwise, so a run of
    rows gives the bits the whole tensor gives."""
    e = elementwise.on_whole_runs(torch.Tensor.exp_, torch.sub(lf, lmax.unsqueeze(-1)))  # in place on the fresh difference
    if real < lf.shape[-1]:
        e[..., real:] = 0.0
    return e


def _local_leaf_sums(lf: torch.Tensor, lmax: torch.Tensor, real: int, width: int) -> torch.Tensor:
    """This rank's vocab leaf sums of exp(lf - lmax), (..., V_local / width), from runs of rows along
    the first dim (no copy of a strided ``lf``): each leaf is the same ``width`` columns of one row."""
    v_local = lf.shape[-1]
    if lf.dim() == 1:
        return _leaf_sums(_shifted_exp(lf, lmax, real).reshape(v_local // width, width))
    per_row = max(1, lf[0].numel())
    step = max(1, EXP_CHUNK_ELEMENTS // per_row)
    runs = [_leaf_sums(_shifted_exp(lf[i:i + step], lmax[i:i + step], real)
                       .reshape(*lf[i:i + step].shape[:-1], v_local // width, width))
            for i in range(0, lf.shape[0], step)]
    return runs[0] if len(runs) == 1 else torch.cat(runs)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, canonical_shards, vocab_size, temperature, pad_multiple):
        world = group_size(group)
        v_local = logits.shape[-1]
        true_vocab = v_local * world if vocab_size is None else vocab_size
        width = vocab_leaf_width(true_vocab, canonical_shards, pad_multiple)
        if v_local % width:
            raise refuse("vocab_leaf_width", v_local=v_local, width=width, vocab=true_vocab)
        vocab_start = group_rank(group) * v_local
        lf = divide_by_temperature(logits, temperature)  # fp32; the caller's logits when fp32 at T = 1
        # Padded columns (ids >= the true vocab) are left out of the max and get exp = 0 exactly:
        # no masked copy of the (tokens, V/TP) logits, and exp(lf - max) only in runs of rows.
        real = min(v_local, max(0, true_vocab - vocab_start))
        local_max = lf[..., :real].amax(-1) if real else lf.new_full(lf.shape[:-1], float("-inf"))
        lmax = max_across_ranks(local_max, group)
        local = _local_leaf_sums(lf, lmax, real, width)  # (..., leaves of this rank)
        total = _fold_vocab_leaves(local, group, -(-true_vocab // width))
        in_range = (target >= vocab_start) & (target < vocab_start + v_local)
        idx = (target - vocab_start).clamp(0, v_local - 1).long()
        picked = torch.where(in_range, lf.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
        if real < v_local:  # a padded id as target: probability 0, as a masked logit gives
            picked = torch.where(in_range & (target >= true_vocab), float("-inf"), picked)
        target_logit = tree_fold(gather_along_rank(picked, group), dim=0)  # one non-zero term: exact
        logprob = (target_logit - lmax) - elementwise.on_whole_runs(torch.log, total)
        # lf is the caller's logits when they are fp32 at temperature 1 (no copy); an in-place change
        # to them before the backward is refused by autograd's version check, never used silently.
        ctx.save_for_backward(lf, lmax, total, in_range, idx)
        ctx.real = real
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        return logprob

    @staticmethod
    def backward(ctx, grad):
        lf, lmax, total, in_range, idx = ctx.saved_tensors
        g = _shifted_exp(lf, lmax, ctx.real)  # the forward's exponentials, recomputed: the same bits
        g = g.div_(total.unsqueeze(-1)).neg_().mul_(grad.unsqueeze(-1))  # -(e / total) * grad, in place
        g.scatter_add_(-1, idx.unsqueeze(-1), torch.where(in_range, grad, 0.0).unsqueeze(-1))
        if ctx.temperature != 1.0:
            g = g / ctx.temperature
        return g.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_logprob(
    logits: torch.Tensor,
    target: torch.Tensor,
    group=None,
    canonical_shards: int = 8,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    pad_multiple: int = 128,
) -> torch.Tensor:
    """log softmax(logits / T)[target] in fp32; ``logits`` holds this rank's vocab shard.

    vocab_size: the true vocab (default: every column is real); columns at or beyond it are excluded
    exactly. pad_multiple: the profile's vocab_pad_multiple (see vocab_leaf_width).
    """
    return _VocabParallelLogprob.apply(logits, target, group, canonical_shards, vocab_size, temperature,
                                       pad_multiple)
