"""MoE layers under bitwise training: the router's and the experts' gradients in canonical order.

The forward is the canonical one (``numerics/canonical/moe_layer.py``); what changes is the backward:

- the router weight's (and bias's) gradient (a sum over tokens; megatron all-reduces it over TP under SP) is one
  invariant GEMM over the whole micro-batch's tokens in sequence order, the SP slices gathered
  (moved), so every TP rank holds it whole and megatron's TP all-reduce is skipped (the weight is
  marked like a norm's, ``models.marks.mark_routers``);
- an expert's weight gradient is, per micro-batch, one invariant GEMM over the rows routed to it in
  global token order (``ExpertRows``): the dispatch brings every row of an expert to its rank(s),
  and the rows of one micro-batch come from its SP slices, put in order. That needs each
  micro-batch's SP slices inside one expert group (EP x expert-TP a multiple of TP; refused
  otherwise). When the expert group spans several DP ranks, an expert sees several micro-batches
  in one backward: each one's gradient goes to its own micro-batch group
  (``accumulation.add_source_grad``), folded over the expert-data-parallel ranks by moving data;
- an expert's biases (gpt-oss; megatron builds them at expert TP 1 only): per micro-batch, the sum of
  their rows' gradients in the weight gradient's order;
- fc1's input gradient, a sum over its expert-TP-split output features, by canonical leaves folded
  across expert TP by moving data (as a column-parallel layer's), so every expert-TP copy of a row's
  gradient is the same; fc2's output fold takes the owner's gradient (moved, not summed);
- a token's gradient from its k expert slots is moved back from the owner rank and summed in slot
  order in fp32, cast once (``CanonicalDispatch``);
- megatron's router losses with their gradient at one device's scale in every layout
  (``router_losses``).
"""
from dataclasses import dataclass
from typing import List

import torch

from ...contract.refusals import refuse
from ...kernels import moe_dispatch
from ...kernels.collectives import fold_across_ranks, gather_along_rank, group_size
from ...kernels.linear import (fold_leaf_products, invariant_input_grad, invariant_linear_values,
                               invariant_weight_grad)
from ...kernels.moe import slot_sum_fp32
from . import accumulation
from .column_parallel import bias_grad, gather_sequence, leaf_rows


def _gather_tokens(x: torch.Tensor, group, seq_split: bool) -> torch.Tensor:
    """(rows, n) of this rank's SP slice -> the micro-batch's rows in sequence order (moved)."""
    return gather_sequence(x, group) if seq_split else x


class RouterLogits(torch.autograd.Function):
    """fp32 router logits by the invariant GEMM (plus the router's bias, gpt-oss); backward: dx row by
    row, dW and the bias's gradient over the whole micro-batch (its SP slices gathered in sequence
    order), the same on every TP rank."""

    @staticmethod
    def forward(ctx, h, weight, bias, group, seq_split, compute, row_multiple):
        ctx.group, ctx.seq_split, ctx.row_multiple = group, seq_split, row_multiple
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(h, weight)
        return compute(h, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        dy = grad.float()
        dx = invariant_input_grad(dy, weight.float(), h.dtype, ctx.row_multiple) if ctx.needs_input_grad[0] else None
        dw = db = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dy_all = _gather_tokens(dy, ctx.group, ctx.seq_split)
            if ctx.needs_input_grad[1]:
                h_all = _gather_tokens(h.float(), ctx.group, ctx.seq_split)
                dw = invariant_weight_grad(dy_all, h_all, weight.dtype, ctx.row_multiple)
            if ctx.needs_input_grad[2]:
                db = bias_grad(dy_all, ctx.bias_dtype, ctx.row_multiple)
        return dx, dw, db, None, None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by a constant."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def router_losses(router, logits: torch.Tensor, padding_mask, tp_cp_group) -> torch.Tensor:
    """megatron's ``router.routing`` (its aux loss and z-loss attached to the probabilities it
    returns) with the losses' gradients at one device's scale in every layout. Under per-token loss
    megatron scales each loss by the rank's token count, and whether it also multiplies by the TP x
    CP size to undo the SP split depends on the megatron-core line (0.19 does, 0.12 and 0.16 do not:
    their gradients come out TP times smaller than one device's). Here the router runs its plain
    (not per-token) path, whose gradient is the same in every layout and line, and that gradient is
    multiplied by the micro-batch's token count (excluding padding, summed over TP x CP: an integer),
    which is what the per-token path means. ``seq_aux_loss`` and ``global_aux_loss`` are refused."""
    config = router.config
    types = config.moe_router_load_balancing_type
    for t in types if isinstance(types, (list, tuple)) else [types]:
        if t not in ("aux_loss", "none"):
            raise refuse("bitwise_moe_router_loss", value=t)
    kwargs = {} if padding_mask is None else {"padding_mask": padding_mask}
    if not getattr(config, "calculate_per_token_loss", False):
        return router.routing(logits, **kwargs)[0]
    if getattr(router, "calculate_per_token_loss", None) is not True:
        raise RuntimeError("bitwise_training: this megatron-core line's router does not keep calculate_per_token_loss "
                           "as an attribute; its router losses' scale cannot be made layout-independent here")
    local = logits.shape[0] * logits.shape[1] if padding_mask is None else (~padding_mask).sum()
    tokens = torch.as_tensor(local, dtype=torch.int64).reshape(1)
    if group_size(tp_cp_group) > 1:
        tokens = gather_along_rank(tokens, tp_cp_group).sum()
    router.calculate_per_token_loss = False
    try:
        return router.routing(ScaleGrad.apply(logits, float(tokens)), **kwargs)[0]
    finally:
        router.calculate_per_token_loss = True


@dataclass
class ExpertRows:
    """The rows of one local expert by micro-batch: ``sources[i] = (dp_rank, rows)``, rows the
    expert-ordered row indices of that micro-batch's tokens in global token order (None: all rows,
    already in order). ``routed`` (several micro-batches): the gradient goes to per-micro-batch groups
    (``accumulation.add_source_grad``); else it is returned to megatron's hook as one micro-batch's and
    accumulated as a dense parameter's."""

    sources: List[tuple]
    routed: bool


def _coordinates(group) -> List[List[int]]:
    """Each group position's (DP rank, TP rank), gathered per forward: one small all-gather next to
    the dispatch's all-to-all (a cache keyed by the group object could outlive a rebuilt parallel state)."""
    from megatron.core import parallel_state as ps

    coords = torch.tensor([ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank()])
    return gather_along_rank(coords, group).tolist()


def expert_rows(plan: moe_dispatch.DispatchPlan, group, expert_buffers: bool) -> List[ExpertRows]:
    """Each local expert's rows by micro-batch, read off the dispatch plan and the group's (DP, TP)
    coordinates; routed to micro-batch groups when the expert group spans several DP ranks (whose
    experts are then in megatron's expert-parallel buffers: ``expert_buffers``). Refuses a layout whose
    micro-batch SP slices are not all in this expert group."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    dp_tp = _coordinates(group)
    by_dp = {}
    for position, (dp, tp_rank) in enumerate(dp_tp):
        by_dp.setdefault(dp, []).append((tp_rank, position))
    for dp, members in by_dp.items():
        if sorted(t for t, _ in members) != list(range(tp)):
            raise refuse("bitwise_moe_token_split", tp=tp, group=len(dp_tp))
    routed = len(by_dp) > 1
    if routed and not expert_buffers:
        raise RuntimeError("bitwise_training: an expert group spanning several DP ranks needs expert-parallel "
                           "gradient buffers (expert_model_parallel_size > 1)")
    rows = []
    offset = 0
    for j, count in enumerate(plan.expert_counts):
        starts, at = [], offset
        for position in range(len(dp_tp)):
            starts.append(at)
            at += plan.recv_blocks[position][j]
        sources = []
        for dp in sorted(by_dp):
            blocks = [(starts[p] - offset, plan.recv_blocks[p][j]) for _, p in sorted(by_dp[dp])]
            contiguous = all(a + n == b for (a, n), (b, _) in zip(blocks, blocks[1:]))
            if len(by_dp) == 1 and contiguous:
                idx = None
            else:
                idx = torch.cat([torch.arange(a, a + n) for a, n in blocks]) if blocks else torch.zeros(0, dtype=torch.long)
            sources.append((dp, idx))
        rows.append(ExpertRows(sources, routed))
        offset += count
    return rows


def _weight_grad(weight: torch.nn.Parameter, dy: torch.Tensor, x, rows: ExpertRows, rm: int):
    """The expert weight's gradient per micro-batch (one invariant GEMM over its rows in token order):
    returned when the rows are one micro-batch's, else added to each micro-batch's group here.
    ``x`` None: ``weight`` is a bias, its gradient the rows' sum (``column_parallel.bias_grad``)."""

    def grad_of(dy_rows, x_rows):
        if x_rows is None:
            return bias_grad(dy_rows, weight.dtype, rm)
        return invariant_weight_grad(dy_rows, x_rows, weight.dtype, rm)

    if not rows.routed:
        (_, idx), = rows.sources
        if idx is not None:
            dy = dy.index_select(0, idx.to(dy.device))
            x = None if x is None else x.index_select(0, idx.to(x.device))
        return grad_of(dy, x)
    step = accumulation.next_source_step(weight)
    dp_ranks = [dp for dp, _ in rows.sources]
    for dp, idx in rows.sources:
        if idx is not None:
            idx = idx.to(dy.device)
            dy_r, x_r = dy.index_select(0, idx), None if x is None else x.index_select(0, idx)
        else:
            dy_r, x_r = dy, x
        dw = grad_of(dy_r, x_r)
        accumulation.add_source_grad(weight, step, dp, dw, dp_ranks)
    # added to the group buffers already: megatron's hook must not add the placeholder (its own
    # convention for gradients accumulated in the backward, as with gradient_accumulation_fusion)
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


class ExpertUpProj(torch.autograd.Function):
    """An expert's fc1 shard on its rows (expert-TP column-parallel). Backward: dx by the canonical
    leaves of the output features folded across expert TP (every copy the same), dW per micro-batch."""

    @staticmethod
    def forward(ctx, x, weight, etp_group, leaves, parts, rows, compute, row_multiple):
        ctx.etp_group, ctx.leaves, ctx.parts, ctx.rows, ctx.rm = etp_group, leaves, parts, rows, row_multiple
        ctx.save_for_backward(x, weight)
        return compute(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dtype = torch.promote_types(x.dtype, weight.dtype)
        dy = grad.to(dtype)
        dw = _weight_grad(weight, dy, x.to(dtype), ctx.rows, ctx.rm) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            order = leaf_rows(weight.shape[0], ctx.parts, ctx.leaves, weight.device)
            dyl, wl = (dy, weight) if order is None else (dy[:, order], weight[order])
            partial = fold_leaf_products(dyl, wl.t().to(dtype), ctx.leaves, ctx.rm)
            dx = fold_across_ranks(partial, ctx.etp_group, x.dtype)
        return dx, dw, None, None, None, None, None, None


class ExpertDownProjLeaves(torch.autograd.Function):
    """An expert's fc2 shard: its C/ETP leaves folded locally (fp32). Backward: dx row by row, dW
    per micro-batch."""

    @staticmethod
    def forward(ctx, a, weight, leaves, rows, row_multiple):
        ctx.rows, ctx.rm = rows, row_multiple
        ctx.save_for_backward(a, weight)
        return fold_leaf_products(a, weight, leaves, row_multiple)

    @staticmethod
    def backward(ctx, grad):
        a, weight = ctx.saved_tensors
        dtype = torch.promote_types(a.dtype, weight.dtype)
        dy = grad.to(dtype)
        dx = invariant_input_grad(dy, weight.to(dtype), a.dtype, ctx.rm) if ctx.needs_input_grad[0] else None
        dw = _weight_grad(weight, dy, a.to(dtype), ctx.rows, ctx.rm) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


class ExpertDownProjLeavesTogether(torch.autograd.Function):
    """``ExpertDownProjLeaves`` of every local expert in one Function (arguments: leaves, the experts'
    rows records, row_multiple, the count n, then n activations and n weights), so that the backward
    computes every expert's dx together: one invariant GEMM each, in shared tiles
    (``invariant_linear_values``, each product's own bits); an expert's 64 fc2 inputs alone padded a
    (128, 7168) x (7168, 384) call. dW per expert, as ``ExpertDownProjLeaves``."""

    @staticmethod
    def forward(ctx, leaves, rows, row_multiple, n, *tensors):
        ctx.rows, ctx.rm, ctx.n = rows, row_multiple, n
        ctx.save_for_backward(*tensors)
        return tuple(fold_leaf_products(a, w, leaves, row_multiple) for a, w in zip(tensors[:n], tensors[n:]))

    @staticmethod
    def backward(ctx, *grads):
        n, saved = ctx.n, ctx.saved_tensors
        acts, weights = saved[:n], saved[n:]
        dtypes = [torch.promote_types(a.dtype, w.dtype) for a, w in zip(acts, weights)]
        dys = [(g if g is not None else torch.zeros(a.shape[0], w.shape[0], dtype=d)).to(d)
               for g, a, w, d in zip(grads, acts, weights, dtypes)]
        need_x, need_w = ctx.needs_input_grad[4:4 + n], ctx.needs_input_grad[4 + n:]
        dxs = [None] * n
        wanted = [i for i in range(n) if need_x[i]]
        by_dtype = {}
        for i in wanted:  # one grouped call per (operand, output) dtype pair: each call's operands alike
            by_dtype.setdefault((dtypes[i], acts[i].dtype), []).append(i)
        for (dtype, out_dtype), members in by_dtype.items():
            values = invariant_linear_values([dys[i] for i in members], [weights[i].to(dtype).t() for i in members],
                                             out_dtype, ctx.rm)
            for i, dx in zip(members, values):
                dxs[i] = dx
        dws = [_weight_grad(w, dy, a.to(d), r, ctx.rm) if need else None
               for w, dy, a, d, r, need in zip(weights, dys, acts, dtypes, ctx.rows, need_w)]
        return (None, None, None, None, *dxs, *dws)


class ExpertBias(torch.autograd.Function):
    """An expert's bias added to its rows (model dtype: fc1's slice, fc2's at expert TP 1); backward: dx = dy, the bias's
    gradient per micro-batch over its rows in token order (as the weight's)."""

    @staticmethod
    def forward(ctx, y, bias, rows, row_multiple):
        ctx.rows, ctx.rm, ctx.bias = rows, row_multiple, bias
        return y + bias

    @staticmethod
    def backward(ctx, grad):
        db = _weight_grad(ctx.bias, grad.float(), None, ctx.rows, ctx.rm) if ctx.needs_input_grad[1] else None
        return grad, db, None, None


class FoldToOwner(torch.autograd.Function):
    """The fc2 partials folded across expert TP (every rank gets the sum); only the owner's copy
    (expert-TP rank 0) goes back to the token, so backward moves the owner's gradient to every rank
    (the others' are zero; nothing is summed)."""

    @staticmethod
    def forward(ctx, partial, etp_group, dtype):
        ctx.etp_group, ctx.in_dtype = etp_group, partial.dtype
        with torch.no_grad():
            return fold_across_ranks(partial, etp_group, dtype)

    @staticmethod
    def backward(ctx, grad):
        owner = gather_along_rank(grad.contiguous(), ctx.etp_group)[0]
        return owner.to(ctx.in_dtype), None, None


class CanonicalDispatch(torch.autograd.Function):
    """``moe_dispatch.dispatch`` (token rows -> the local experts' rows, in one tensor). Backward:
    each row's gradient back to its token's rank from the owner only (every expert-TP copy holds the
    same), then a token's k slot gradients summed in slot order in fp32, cast once."""

    @staticmethod
    def forward(ctx, h, plan, group, k):
        ctx.plan, ctx.group, ctx.k, ctx.dtype, ctx.tokens = plan, group, k, h.dtype, h.shape[0]
        with torch.no_grad():
            return torch.cat(moe_dispatch.dispatch(h, plan, group)) if plan.expert_counts else h[:0]

    @staticmethod
    def backward(ctx, grad):
        p = ctx.plan
        slots = moe_dispatch.combine(list(grad.split(p.expert_counts)), p, ctx.group, ctx.tokens, ctx.k)
        return slot_sum_fp32(slots).to(ctx.dtype), None, None, None


def check_token_split(tp: int, etp: int, ep: int) -> None:
    """A micro-batch's SP slices must meet in one expert group (its gradient rows in one place)."""
    if tp > 1 and (ep * etp) % tp:
        raise refuse("bitwise_moe_token_split", tp=tp, group=ep * etp)
