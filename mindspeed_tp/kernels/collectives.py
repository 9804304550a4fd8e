"""Cross-rank sums in canonical order: move data with the collective library, add locally.

The collective library never adds (its order and dtype are its own choice). Each rank holds the
fp32 result of its own subtree (a contiguous run of C/TP leaves); the upper log2(TP) tree levels
are folded locally in rank order after an all-to-all of row slices. Bytes moved stay close to one
ring all-reduce: an fp32 all-to-all, plus an all-gather of the cast result when every rank needs
all rows.
"""
import torch
import torch.distributed as dist

from ..contract.tree import tree_fold


def group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def all_to_all_slots(x: torch.Tensor, group) -> torch.Tensor:
    """x: (world*r, n) -> (world, r, n) where slot i holds rank i's slice for this rank. No autograd:
    for code inside an autograd Function's forward or backward (``all_to_all_rows`` is the
    differentiable one)."""
    world = group_size(group)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out.reshape(world, x.shape[0] // world, *x.shape[1:])


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows of ``x`` stacked in rank order along dim 0 (world * rows). No autograd: for
    code inside an autograd Function's forward or backward."""
    world = group_size(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _fold_rows(partial: torch.Tensor, group, out_dtype) -> torch.Tensor:
    """(rows, n) fp32 subtree result -> this rank's rows/world slice of the tree sum, cast."""
    received = all_to_all_slots(partial, group)
    return tree_fold(received, dim=0).to(out_dtype)


class _FoldScatter(torch.autograd.Function):
    """Tree-ordered reduce-scatter along dim 0 (sequence parallel). Backward: all-gather."""

    @staticmethod
    def forward(ctx, partial, group, out_dtype):
        ctx.group = group
        ctx.in_dtype = partial.dtype
        shape = partial.shape
        flat = partial.reshape(shape[0], -1)
        out = _fold_rows(flat, group, out_dtype)
        return out.reshape(shape[0] // group_size(group), *shape[1:])

    @staticmethod
    def backward(ctx, grad):
        shape = grad.shape
        full = all_gather_rows(grad.reshape(shape[0], -1), ctx.group)
        return full.reshape(-1, *shape[1:]).to(ctx.in_dtype), None, None


class _FoldAll(torch.autograd.Function):
    """Tree-ordered all-reduce: fold a row slice per rank, then all-gather. Backward: identity
    when every rank's output feeds a replicated computation (as for Megatron's all-reduce);
    otherwise (the ranks' copies are used once between them) the copies' gradients are summed."""

    @staticmethod
    def forward(ctx, partial, group, out_dtype, replicated_output=True):
        ctx.in_dtype, ctx.group, ctx.replicated = partial.dtype, group, replicated_output
        world = group_size(group)
        shape = partial.shape
        flat = partial.reshape(-1, shape[-1]) if partial.dim() > 1 else partial.reshape(-1, 1)
        rows = flat.shape[0]
        padded = -(-rows // world) * world
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
        mine = _fold_rows(flat, group, out_dtype)
        return all_gather_rows(mine, group)[:rows].reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.to(ctx.in_dtype)
        if not ctx.replicated:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None, None


class _AllToAllRows(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its own inverse, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_to_all_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Slice i of dim 0 goes to rank i; slot i of the result came from rank i (differentiable)."""
    if group_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, group)


class _AllToAllSplit(torch.autograd.Function):
    """All-to-all of rows with split sizes (Python ints): the first sum(send) rows of x go out,
    send[i] of them to rank i; recv[i] rows come from rank i, in rank order. Backward: the same
    exchange reversed; rows of x that were not sent get a zero gradient (they stay in the graph, so
    a rank that sends nothing still runs the backward of what produced them)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.group, ctx.send, ctx.recv, ctx.rows = group, send, recv, x.shape[0]
        n = sum(send)
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x[:n].contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        dist.all_to_all_single(back[:sum(ctx.send)], grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all_split(x: torch.Tensor, send, recv, group) -> torch.Tensor:
    """Differentiable all-to-all of rows with split sizes: rows [sum(send[:i]), sum(send[:i+1]))
    of x go to rank i; the result holds recv[i] rows from rank i, in rank order. Rows of x past
    sum(send) are not sent (zero gradient)."""
    if group_size(group) == 1:
        return x[:sum(send)]
    return _AllToAllSplit.apply(x, list(send), list(recv), group)


class _GatherLastDimSumGrad(torch.autograd.Function):
    """All-gather along the last dim for a computation that differs per rank (each rank uses the
    full tensor with its own weights): backward sums the ranks' gradients and keeps this rank's
    slice (reduce-scatter). Gradients only, so the library's own sum order is acceptable here."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = group_size(group)
        gathered = all_gather_rows(x.reshape(1, -1), group).reshape(world, *x.shape)
        return gathered.movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        world = group_size(ctx.group)
        n = grad.shape[-1] // world
        parts = grad.reshape(*grad.shape[:-1], world, n).movedim(-2, 0).contiguous()
        out = grad.new_empty(parts[0].numel())
        dist.reduce_scatter_tensor(out, parts.reshape(-1), group=ctx.group)
        return out.reshape(parts.shape[1:]), None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim of a result every rank then uses identically (replicated
    downstream, like Megatron's all-reduce output): backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _GatherLastDimSumGrad.forward(ctx, x, group)

    @staticmethod
    def backward(ctx, grad):
        world, rank = group_size(ctx.group), dist.get_rank(group=ctx.group)
        n = grad.shape[-1] // world
        return grad[..., rank * n:(rank + 1) * n].contiguous(), None


class _ColumnsToRows(torch.autograd.Function):
    """(M, n) column block per rank -> (M/world, world*n): rank r gets rows slice r with every
    rank's columns, in rank order (the SP layout of a column-sharded result). Backward: inverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = group_size(group)
        m, n = x.shape
        received = all_to_all_slots(x, group)  # (world, m/world, n): slot s = rank s's columns
        return received.permute(1, 0, 2).reshape(m // world, world * n)

    @staticmethod
    def backward(ctx, grad):
        world = group_size(ctx.group)
        rows, n = grad.shape[0], grad.shape[1] // world
        blocks = grad.reshape(rows, world, n).permute(1, 0, 2).reshape(world * rows, n)
        return all_to_all_slots(blocks, ctx.group).reshape(world * rows, n), None


def gather_last_dim(x: torch.Tensor, group, replicated_downstream: bool) -> torch.Tensor:
    """Differentiable all-gather along the last dim, rank order. replicated_downstream: every rank
    uses the result identically (backward: own slice); otherwise backward sums over ranks."""
    if group_size(group) == 1:
        return x
    return (_GatherLastDim if replicated_downstream else _GatherLastDimSumGrad).apply(x, group)


def columns_to_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable (M, n) per rank -> (M/world, world*n): column shards to row shards."""
    if group_size(group) == 1:
        return x
    if x.shape[0] % group_size(group):
        raise ValueError(f"{x.shape[0]} rows do not split evenly over {group_size(group)} ranks")
    return _ColumnsToRows.apply(x, group)


def fold_across_ranks(
    partial: torch.Tensor, group, out_dtype: torch.dtype, scatter_dim0: bool = False, replicated_output: bool = True
) -> torch.Tensor:
    """Sum each rank's fp32 subtree result over ``group`` in canonical (rank) order.

    scatter_dim0=False: every rank gets the full sum (replaces all-reduce).
    scatter_dim0=True: rank r gets slice r of dim 0 (replaces the SP reduce-scatter).
    replicated_output=False (with scatter_dim0=False): the ranks' copies of the sum are not each
    used in full (MoE: one expert-TP rank's copy goes back to the token), so backward sums them.
    """
    if group_size(group) == 1:
        return partial.to(out_dtype)
    if scatter_dim0:
        return _FoldScatter.apply(partial, group, out_dtype)
    return _FoldAll.apply(partial, group, out_dtype, replicated_output)


def gather_along_rank(x: torch.Tensor, group) -> torch.Tensor:
    """(…) per rank -> (world, …), slot i from rank i. Not differentiable."""
    world = group_size(group)
    if world == 1:
        return x.unsqueeze(0)
    flat = x.reshape(1, -1).contiguous()
    out = x.new_empty((world, flat.shape[1]))
    dist.all_gather_into_tensor(out, flat, group=group)
    return out.reshape(world, *x.shape)


def max_across_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """Element-wise max over ranks: exact whatever the order, so the library may do it."""
    if group_size(group) == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def group_rank(group) -> int:
    return dist.get_rank(group=group) if group_size(group) > 1 else 0


__all__ = [
    "all_to_all_rows",
    "all_to_all_split",
    "columns_to_rows",
    "gather_last_dim",
    "fold_across_ranks",
    "group_size",
    "gather_along_rank",
    "max_across_ranks",
    "group_rank",
]
