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

A rank holding several groups accumulates its last one (in bit-reversed order) in ``main_grad`` and
each other one in an fp32 buffer of its own (G/DP - 1 buffers, kept across steps; none at DP = G).
A rank holding exactly two groups of one micro-batch each needs no buffer: their tree is one addition
of the two micro-batch gradients, which ``main_grad``'s own chain ``(0 + m_a) + m_b`` computes bit
for bit (addition commutes; ``0 +`` turns -0.0 into +0.0 on both paths).
Expert weights whose expert group spans several DP ranks (expert-parallel buffers) see several
micro-batches in one backward: their backward adds each micro-batch's gradient to that micro-batch's
group itself (``add_source_grad``: the last group in tree order in main_grad, each other in a buffer
of its own), and the bucket group's sync
folds all G groups over the expert-data-parallel ranks by moving data (``reduce_source_routed``):
which groups a rank holds then follows the expert groups, not the DP subtrees.

The backward hook (``route_microbatch``) runs before Megatron's own hook: a micro-batch of another
group is added to that group's buffer and Megatron's hook is told it was added already
(``grad_added_to_main_grad``). ``fold_groups`` runs when a bucket group starts its gradient sync
(after the last micro-batch, with or without overlap_grad_reduce): the tree over the rank's groups,
written into ``main_grad``.
"""
from typing import Dict

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ...contract.refusals import refuse
from ...contract.tree import tree_fold
from ...errors import ConfigError
from ...kernels.collectives import all_gather_rows, all_to_all_slots, gather_along_rank
from ...models.marks import TIED_HEAD_ATTR
from .context_parallel import cp_copy_members, cp_group

# Set per forward_backward call by the schedule wrapper.
_plan: Dict[str, int] = {}
# Per gradient holder (a parameter), by identity and weakly: a holder
# freed and another allocated at its address never inherit its count.
_counts = WeakIdKeyDictionary()
_buffered = WeakIdKeyDictionary()  # holders with group buffers (-> True), zeroed by reset()
# On a parameter: {group: fp32 buffer}, living as long as it does.
BUFFERS_ATTR = "_mindspeed_tp_group_buffers"
HOOKED_ATTR = "_mindspeed_tp_bitwise_hook"
# Tied embeddings on one stage (PP=1, marked TIED_HEAD_ATTR at model build): the input embedding's
# share of the shared weight's gradient, kept apart as on a pipeline's first stage and added once,
# after both are accumulated and DP-reduced; as rows (the step's distinct token ids), by group:
# {weight: {group: (rows, fp32 values)}}, and the micro-batches seen.
_embedding_rows = WeakIdKeyDictionary()
_embedding_counts = WeakIdKeyDictionary()
# Source-routed expert weights: backward passes seen this step (the micro-batch step k).
_source_steps = WeakIdKeyDictionary()
# A source-routed expert weight's groups this step: (the one kept in main_grad, all it holds).
SOURCE_GROUPS_ATTR = "_mindspeed_tp_source_groups"


def set_schedule(num_microbatches: int, dp: int, dp_rank: int, groups: int) -> None:
    """Validate and record one step's micro-batch plan (called by the schedule wrapper)."""
    total = num_microbatches * dp
    if groups % dp or total % groups or total & (total - 1):
        raise refuse("bitwise_microbatch_groups", microbatches=num_microbatches, dp=dp, groups=groups)
    _plan.clear()
    _plan.update(local=num_microbatches, dp=dp, dp_rank=dp_rank, groups=groups)
    # This rank's groups in tree order, and the one accumulated in main_grad (the last): fixed per step.
    _plan["rank_groups"] = sorted({_group(k) for k in range(num_microbatches)},
                                  key=lambda g: _bit_reversed(g, groups))
    _plan["home"] = _plan["rank_groups"][-1]
    _plan["direct"] = num_microbatches == 2 and len(_plan["rank_groups"]) == 2


def _group(k: int) -> int:
    """The group of this rank's k-th micro-batch."""
    return (k * _plan["dp"] + _plan["dp_rank"]) % _plan["groups"]


def _bit_reversed(g: int, groups: int) -> int:
    bits = groups.bit_length() - 1
    return int(format(g, f"0{bits}b")[::-1], 2) if bits else 0


def _require_plan() -> None:
    if not _plan:
        raise ConfigError("bitwise_training: a backward pass ran outside megatron's forward_backward_func (the "
                          "micro-batch plan is unknown); run training steps through get_forward_backward_func()")


def route_microbatch(holder, grad: torch.Tensor) -> bool:
    """Before micro-batch k's gradient ``grad`` is added to ``holder.main_grad``: if k belongs to
    another group than main_grad's, add it to that group's buffer and return True (added)."""
    _require_plan()
    k = _counts.get(holder, 0)
    _counts[holder] = k + 1
    g = _group(k)
    if g == _plan["home"] or _plan["direct"]:
        return False
    _add_to_group_buffer(holder, g, grad)
    return True


def _add_to_group_buffer(holder, g: int, grad: torch.Tensor) -> None:
    """``grad`` added to the fp32 buffer of group ``g`` on ``holder`` (made at first use, kept)."""
    buffers = getattr(holder, BUFFERS_ATTR, None)
    if buffers is None:
        buffers = {}
        setattr(holder, BUFFERS_ATTR, buffers)
    buf = buffers.get(g)
    if buf is None:
        buf = buffers[g] = torch.zeros_like(holder.main_grad)
    _buffered[holder] = True
    buf.add_(grad)


def next_source_step(param) -> int:
    """The micro-batch step (0, 1, ...) of this backward of a source-routed expert weight."""
    _require_plan()
    k = _source_steps.get(param, 0)
    _source_steps[param] = k + 1
    return k


def add_source_grad(param, step: int, dp_rank: int, grad: torch.Tensor, dp_ranks) -> None:
    """DP rank ``dp_rank``'s micro-batch of step ``step`` (j = step*DP + dp_rank) contributed ``grad``:
    added to its group's chain (j order, as main_grad's). ``dp_ranks``: the DP ranks whose micro-batches
    this expert sees; of the groups they give, the last in tree order accumulates in main_grad (as a
    dense parameter's home group), each other in a buffer of its own."""
    g = (step * _plan["dp"] + dp_rank) % _plan["groups"]
    held = {(k * _plan["dp"] + r) % _plan["groups"] for k in range(_plan["local"]) for r in dp_ranks}
    home = max(held, key=lambda x: _bit_reversed(x, _plan["groups"]))
    setattr(param, SOURCE_GROUPS_ATTR, (home, held))
    if g == home:
        param.main_grad.add_(grad)
    else:
        _add_to_group_buffer(param, g, grad)


def _source_chains(param) -> dict:
    """A source-routed expert weight's group chains on this rank this step: its buffers and main_grad."""
    home, held = getattr(param, SOURCE_GROUPS_ATTR)
    buffers = getattr(param, BUFFERS_ATTR, None) or {}
    return {g: param.main_grad if g == home else buffers[g] for g in held}


def source_routed(params) -> bool:
    """Whether a bucket group's parameters are source-routed expert weights (all or none)."""
    routed = [p in _source_steps for p in params]
    if any(routed) and not all(routed):
        raise RuntimeError("bitwise_training: a gradient bucket mixes expert weights of an expert group spanning "
                           "several DP ranks with other parameters")
    return bool(routed) and routed[0]


def reduce_source_routed(bucket_group, sharded: bool) -> None:
    """The sync of a source-routed bucket group: every member's group buffers cut into one slice per
    member, slice i moved to member i, where the G groups' slices are folded by the tree (groups in
    bit-reversed order, as every other gradient's); then kept as the member's shard (distributed
    optimizer) or gathered back. Scaling and averaging as megatron's collective."""
    group = _sync_group(bucket_group)
    world = dist.get_world_size(group=group)
    groups = _plan["groups"]
    for param in bucket_group.params:
        if _source_steps.get(param) != _plan["local"]:
            raise RuntimeError(f"bitwise_training: an expert weight received {_source_steps.get(param)} micro-batch "
                               f"gradients, the schedule ran {_plan['local']}")
    for bucket in bucket_group.buckets:
        data = bucket.grad_data
        n = data.numel()
        per = -(-n // world)
        held = sorted(_source_chains(next(iter(bucket.params))))
        stack = data.new_zeros(len(held), per * world)
        for param in bucket.params:
            chains = _source_chains(param)
            if sorted(chains) != held:
                raise RuntimeError("bitwise_training: the expert weights of one bucket hold different micro-batch groups")
            start = (param.main_grad.data_ptr() - data.data_ptr()) // data.element_size()
            for i, g in enumerate(held):
                stack[i, start:start + param.numel()] = chains[g].reshape(-1)
        everyone = gather_along_rank(torch.tensor(held, dtype=torch.long), group).tolist() if world > 1 else [held]
        slot = {g: (member, i) for member, gs in enumerate(everyone) for i, g in enumerate(gs)}
        if sorted(slot) != list(range(groups)) or len({len(gs) for gs in everyone}) != 1:
            raise RuntimeError(f"bitwise_training: the expert-data-parallel ranks hold micro-batch groups {everyone}, "
                               f"expected each of the {groups} groups once")
        order = [slot[g] for g in sorted(range(groups), key=lambda g: _bit_reversed(g, groups))]
        _fold_moved_slices(bucket_group, bucket, stack, order, sharded)
        for param in bucket.params:
            for buf in (getattr(param, BUFFERS_ATTR, None) or {}).values():
                buf.zero_()
    if bucket_group.ddp_config.overlap_grad_reduce:
        bucket_group.grad_reduce_handle = _Done()


def add_embedding_rows(weight, rows: torch.Tensor, values: torch.Tensor) -> None:
    """The input embedding's gradient of this micro-batch on a tied weight (PP=1): ``values`` at the
    sorted distinct ``rows``, added to its micro-batch group's chain of rows (vanilla's main_grad chain
    restricted to the rows that are not +0.0 in every term: adding +0.0 to it changes nothing)."""
    _require_plan()
    k = _embedding_counts.get(weight, 0)
    _embedding_counts[weight] = k + 1
    chains = _embedding_rows.get(weight)
    if chains is None:
        chains = _embedding_rows[weight] = {}
    g = _group(k)
    chain = chains.get(g)
    union = rows if chain is None else torch.unique(torch.cat([chain[0], rows]))
    total = _spread(chain, union, values)
    total.index_add_(0, torch.searchsorted(union, rows), values.float())
    chains[g] = (union, total)


def _spread(chain, onto: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A chain of rows (rows, values; or None) as fp32 values at the sorted rows ``onto`` (a superset),
    +0.0 at the others (what the dense chain holds there)."""
    out = torch.zeros((onto.numel(), like.shape[-1]), dtype=torch.float32, device=like.device)
    if chain is not None:
        out.index_copy_(0, torch.searchsorted(onto, chain[0]), chain[1])
    return out


def _folded_embedding_rows(weight):
    """This rank's groups of a tied weight's embedding rows folded by the tree (as ``_fold`` folds a
    parameter's): (rows, values)."""
    seen = _embedding_counts.get(weight, 0)
    if not seen:
        raise RuntimeError("bitwise_training: the tied word embedding's gradient did not come through its lookup "
                           "(VocabParallelEmbedding.forward's patch); its rows cannot be added apart")
    if seen != _plan["local"]:
        raise RuntimeError(f"bitwise_training: a tied embedding received {seen} micro-batch gradients, the schedule "
                           f"ran {_plan['local']}; every micro-batch must run the embedding")
    chains = _embedding_rows[weight]
    leaves = [chains[g] for g in _plan["rank_groups"]]
    if len(leaves) == 1:
        return leaves[0]
    union = torch.unique(torch.cat([rows for rows, _ in leaves]))
    return union, _fold_rank_leaves([_spread(leaf, union, leaf[1]) for leaf in leaves])


def _fold_rank_leaves(leaves):
    """A rank's group leaves (in tree order) folded by the tree: one as it is, two by one addition
    into the last (the same bits in either operand order), more by ``tree_fold``."""
    if len(leaves) == 1:
        return leaves[0]
    if len(leaves) == 2:
        return leaves[1].add_(leaves[0])
    return tree_fold(torch.stack(leaves), dim=0)


def _fold(holder) -> None:
    seen = _counts.pop(holder, 0)
    if seen and seen != _plan.get("local"):
        raise RuntimeError(f"bitwise_training: a parameter received {seen} micro-batch gradients, the schedule "
                           f"ran {_plan.get('local')}; every parameter must be used by every micro-batch")
    buffers = getattr(holder, BUFFERS_ATTR, None)
    if not seen or not buffers or _plan["direct"]:
        return
    # main_grad holds the home group, the last leaf: two leaves add into it in place.
    folded = _fold_rank_leaves([holder.main_grad if g == _plan["home"] else buffers[g] for g in _plan["rank_groups"]])
    if folded is not holder.main_grad:
        holder.main_grad.copy_(folded)
    for buf in buffers.values():
        buf.zero_()


def fold_groups(params) -> None:
    """Fold this rank's group chains into main_grad by the tree (before the DP reduction)."""
    for param in params:
        if not getattr(param, HOOKED_ATTR, False):
            raise ConfigError("bitwise_training: this DistributedDataParallel was built before mindspeed-tp was "
                              "enabled with bitwise_training, so its gradient hooks are megatron's own; enable first, "
                              "then build the model and DDP")
        _fold(param)


def add_tied_embeddings(model) -> None:
    """After the DP reduction (finalize's word-embedding step): each tied weight's embedding rows,
    scaled and DP-reduced as its bucket is (the rows any DP rank holds; the ranks' values folded in the
    tree's order by moving slices; one CP copy each), added once to the parameter's reduced gradient
    (the LM head's) -- what the all-reduce between a pipeline's first and last stage computes."""
    for weight, bucket_group in _tied_weights(model):
        rows, values = _folded_embedding_rows(weight)
        group = _sync_group(bucket_group)
        world = dist.get_world_size(group=group)
        if world > 1:  # the rows any member holds, +0.0 where a member holds none
            present = torch.zeros(weight.shape[0], dtype=torch.uint8, device=rows.device)
            present[rows] = 1
            union = gather_along_rank(present, group).amax(dim=0).nonzero().flatten()
            values, rows = _spread((rows, values), union, values), union
        factor = bucket_group.param_to_bucket[weight].gradient_scaling_factor
        if factor != 1.0:
            values *= factor
        if world > 1:  # under CP the copies are equal: the DP ranks' values folded, one CP copy each
            order = dp_tree_order() if cp_group() is None else cp_copy_members(group, dp_tree_order())
            values = _fold_over_ranks(values, group, order)
        if world > 1 and bucket_group.ddp_config.average_in_collective:
            values /= world
        # The sum with the embedding's +0.0 outside its rows (-0.0 there becomes +0.0), its values on them.
        heads = weight.main_grad.index_select(0, rows)
        weight.main_grad.add_(0.0)
        weight.main_grad.index_copy_(0, rows, heads.add_(values))
    _embedding_rows.clear()
    _embedding_counts.clear()


def _tied_weights(model):
    """(weight, its bucket group) of every word embedding marked tied to the LM head on this stage."""
    for chunk in model:
        for param, bucket_group in getattr(chunk, "param_to_bucket_group", {}).items():
            if getattr(param, TIED_HEAD_ATTR, False):
                yield param, bucket_group


def _fold_over_ranks(values: torch.Tensor, group, order) -> torch.Tensor:
    """The members' ``values`` (same shape on each) folded by the tree in ``order`` (group ranks),
    on every member: cut into one slice per member and moved (all-to-all), each slice folded by its
    member, gathered back -- as a bucket's tree reduction (``fold_bucket_slices``)."""
    world = dist.get_world_size(group=group)
    flat = _padded(values.reshape(-1), world)
    mine = _fold_slices(flat.view(1, -1), group, [(member, 0) for member in order])
    return _gathered(mine, group, values.numel()).view_as(values)


def _padded(flat: torch.Tensor, world: int) -> torch.Tensor:
    """``flat`` with zeros appended to a multiple of ``world`` (one equal slice per member)."""
    pad = -flat.numel() % world
    return flat if not pad else torch.cat([flat, flat.new_zeros(pad)])


def _fold_slices(leaves: torch.Tensor, group, order) -> torch.Tensor:
    """``leaves`` (L, world * per): this member's L leaves. Slice i of every leaf moves to member i
    (all-to-all), which folds the group's leaves by the tree in ``order`` ((member, leaf) pairs):
    this member's folded slice (per,)."""
    world = dist.get_world_size(group=group)
    count, per = leaves.shape[0], leaves.shape[1] // world
    send = leaves.view(count, world, per).transpose(0, 1).reshape(world, count * per)
    received = all_to_all_slots(send, group).view(world, count, per) if world > 1 else send.view(1, count, per)
    return tree_fold(torch.stack([received[member, leaf] for member, leaf in order]), dim=0)


def _gathered(mine: torch.Tensor, group, n: int) -> torch.Tensor:
    """Every member's folded slice gathered back, in member order: the first ``n`` elements."""
    whole = all_gather_rows(mine.view(1, -1), group).view(-1) if dist.get_world_size(group=group) > 1 else mine
    return whole[:n]


class _Done:
    """The handle megatron waits on after an overlapped sync; this reduction is already complete."""

    def wait(self):
        return None


def dp_tree_order() -> list:
    """The DP ranks in the tree's leaf order (bit-reversed: rank r holds the groups = r mod DP)."""
    dp = _plan["dp"]
    return sorted(range(dp), key=lambda r: _bit_reversed(r, dp))


def reduce_over_dp(bucket_group, sharded: bool) -> None:
    """The DP levels of the tree for DP > 2, replacing the bucket group's all-reduce / reduce-scatter:
    the slices of every DP rank folded in the tree's leaf order (ranks in bit-reversed order: rank r
    holds the groups = r mod DP, a subtree)."""
    dp = dist.get_world_size(group=_sync_group(bucket_group))
    fold_bucket_slices(bucket_group, sharded, sorted(range(dp), key=lambda r: _bit_reversed(r, dp)))


def _sync_group(bucket_group):
    return bucket_group.intra_distributed_optimizer_instance_group \
        if bucket_group.ddp_config.use_distributed_optimizer else bucket_group.data_parallel_group


def reduce_over_dp_cp(bucket_group, sharded: bool, dp_order) -> None:
    """The DP x CP gradient sync when every CP rank holds its DP replica's whole gradient: the
    CP-rank-0 copy of every DP rank's slice folded in the tree's DP order (``dp_order``: the DP ranks
    in the tree's leaf order; one DP rank: the copy itself, nothing added). Replaces megatron's
    reduction over the DP x CP group, which would add the CP copies."""
    fold_bucket_slices(bucket_group, sharded, cp_copy_members(_sync_group(bucket_group), dp_order))


def fold_bucket_slices(bucket_group, sharded: bool, picks) -> None:
    """A bucket group's gradient sync by moving data: every member's bucket cut into one slice per
    member, slice i moved to member i (all-to-all), where the slices of the members ``picks`` are
    folded by the tree in that order; then gathered back (all-reduce) or kept as the member's shard
    (distributed optimizer). Averaging divides by the group's size, as megatron's collective does."""
    world = dist.get_world_size(group=_sync_group(bucket_group))
    for bucket in bucket_group.buckets:
        flat = _padded(bucket.grad_data, world)
        _fold_moved_slices(bucket_group, bucket, flat.view(1, -1), [(p, 0) for p in picks], sharded)
    if bucket_group.ddp_config.overlap_grad_reduce:
        bucket_group.grad_reduce_handle = _Done()


def _fold_moved_slices(bucket_group, bucket, leaves, order, sharded: bool) -> None:
    """``leaves`` (L, world * per): this member's L leaves of ``bucket``'s gradient (scaled here by the
    bucket's factor, as megatron's collective scales). Slice i of every leaf moves to member i, which
    folds the group's leaves by the tree in ``order`` ((member, leaf) pairs); then the result is kept
    as the member's shard (``sharded``: the distributed optimizer pads buckets to a multiple of the
    group's size) or gathered back into the bucket. Averaging divides by the group's size."""
    group = _sync_group(bucket_group)
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    data = bucket.grad_data
    if bucket.gradient_scaling_factor != 1.0:
        leaves *= bucket.gradient_scaling_factor
    mine = _fold_slices(leaves, group, order)
    if bucket_group.ddp_config.average_in_collective:
        mine /= world
    if sharded:
        data.view(world, -1)[rank].copy_(mine)
    else:
        data.copy_(_gathered(mine, group, data.numel()))


def reset() -> None:
    """A new step: the counts start over and every group buffer is zero (they are kept
    and zeroed after use; a step that raised after some micro-batches were routed leaves partial sums
    that must not reach the next one); a tied embedding's rows are dropped."""
    _counts.clear()
    _source_steps.clear()
    for holder in list(_buffered):
        for buf in getattr(holder, BUFFERS_ATTR, {}).values():
            buf.zero_()
    _embedding_rows.clear()
    _embedding_counts.clear()
