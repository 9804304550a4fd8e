"""The bitwise-training strategy's megatron-core patch entries (the strategy: ``strategy.py``).

Its patch entries (megatron-core's DDP, schedules, finalize and clipping) do nothing unless this
strategy is active, then:
- DDP construction: refuses what the mode does not cover (MoE, several
  distributed-optimizer instances) -- its own refusals run at model build and in the kernels;
- the schedule (``get_forward_backward_func``'s result): records and checks the micro-batch plan of
  a training step (a ``forward_only`` call is left alone);
- DDP's backward hook: routes each micro-batch's gradient to its group (``accumulation``);
- a bucket group's ``start_grad_sync``: folds the groups before the DP reduction, and for DP > 2
  replaces the reduction by the tree folded by moving data;
- finalize's TP all-reduce of norm gradients: skipped, they were folded across TP in the backward
  (``token_sums``); megatron's own function is dry-run to learn which gradients it would reduce, and
  any that is not a per-token layer's (a category a future line adds included) is refused;
- the word embedding's forward (``embedding.py``): on one stage with tied
  embeddings, its gradient kept apart as rows of the step's token ids; under CP, from the whole
  micro-batch;
- finalize's word-embedding all-reduce: on one stage with tied embeddings, adds the embedding's rows,
  DP-reduced, to the shared weight's gradient (``accumulation.add_tied_embeddings``);
- ``get_grad_norm_fp32``: the exact sum of squares (``grad_norm``);
- under context parallelism (``context_parallel.py``): the backward's sums
  over the sequence on the whole micro-batch gathered over CP, attention on the whole sequence's
  queries, the embedding's gradient from the whole micro-batch, and the DP x CP gradient sync folding the DP ranks' values only.
"""
import math
import sys

import torch
import torch.distributed as dist

from ... import compat
from ...contract.refusals import refuse
from ...models.marks import PER_TOKEN_PARAM_ATTR
from ...patching import PatchRegistry
from .. import ACTIVE
from . import accumulation, embedding, experts
from . import context_parallel as cp_training
from .grad_norm import grad_norm, norm_of, square_sums
from .strategy import active

DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
BUCKETS = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"
FINALIZE = "megatron.core.distributed.finalize_model_grads"


def check_ddp(module, ddp_config) -> None:
    """What bitwise training refuses, read off the model and the DDP config."""
    config = getattr(module, "config", None)
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1 and compat.megatron_line() < (0, 16):
        raise refuse("bitwise_context_parallel_line", cp=cp, version=compat.megatron_version())
    if cp > 1 and not getattr(config, "calculate_per_token_loss", False):
        raise refuse("bitwise_per_rank_mean_loss", cp=cp)
    if getattr(config, "num_moe_experts", None):
        if (getattr(config, "context_parallel_size", 1) or 1) > 1:
            raise refuse("bitwise_moe_context_parallel")
        tp = config.tensor_model_parallel_size
        experts.check_token_split(tp, getattr(config, "expert_tensor_parallel_size", None) or tp,
                                  config.expert_model_parallel_size)
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    if instances != 1:
        raise refuse("bitwise_ddp_setting", setting="num_distributed_optimizer_instances", value=instances,
                     why="the all-reduce across optimizer instances adds in the library's order")
    if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(ddp_config, "use_custom_fsdp", False):
        raise refuse("bitwise_ddp_setting", setting="use_megatron_fsdp", value=True,
                     why="FSDP reduces gradients in its own buffers")


def ddp_init(original):
    def __init__(self, config, ddp_config, module, *args, **kwargs):
        if active():
            check_ddp(module, ddp_config)
        original(self, config, ddp_config, module, *args, **kwargs)

    return __init__


def backward_post_hook(original):
    def _make_backward_post_hook(self, param):
        hook = original(self, param)
        setattr(param, accumulation.HOOKED_ATTR, True)

        def bitwise_hook(*unused):
            if active() and param in self.param_to_bucket_group and param.grad is not None \
                    and not param.grad_added_to_main_grad:
                if accumulation.route_microbatch(param, param.grad.data):
                    # added to its group's buffer: megatron's hook must not add it to main_grad too
                    # (zero_out_wgrad, set on a tied weight at PP=1, would make it add regardless)
                    zero_out = getattr(param, "zero_out_wgrad", None)
                    param.grad_added_to_main_grad = True
                    if zero_out is not None:
                        param.zero_out_wgrad = False
                    try:
                        return hook(*unused)
                    finally:
                        param.grad_added_to_main_grad = False
                        if zero_out is not None:
                            param.zero_out_wgrad = zero_out
            return hook(*unused)

        return bitwise_hook

    return _make_backward_post_hook


def _dp_size(bucket_group) -> int:
    sharded = bucket_group.ddp_config.use_distributed_optimizer
    group = bucket_group.intra_distributed_optimizer_instance_group if sharded else bucket_group.data_parallel_group
    return dist.get_world_size(group=group)


def _sharded_sync(bucket_group, args, kwargs, reduction: str) -> bool:
    """For a sync this module runs itself (``reduction``): refuses the NaN check megatron's collective
    would run; whether each rank keeps only its shard (distributed optimizer, unless megatron 0.16+'s
    force_all_reduce asks every rank to keep the whole reduced bucket)."""
    if bucket_group.ddp_config.check_for_nan_in_grad:
        raise refuse("bitwise_ddp_setting", setting="check_for_nan_in_grad", value=True,
                     why=f"not run by {reduction}; check the gradient norm (NaN when any gradient is) instead")
    force = kwargs.get("force_all_reduce", args[0] if args else False)
    return bucket_group.ddp_config.use_distributed_optimizer and not force


def start_grad_sync(original):
    def wrapped(self, *args, **kwargs):
        if active():
            if getattr(self, "is_first_batch", False) and getattr(self, "grad_reduce_handle", None) is not None:
                # megatron's own guard: in the first batch the schedule may start a sync the backward
                # hook already started (a pipeline's grad_sync_func, then finish_grad_sync); once only
                return None
            if accumulation.source_routed(self.params):  # expert weights of groups spanning DP ranks
                accumulation.reduce_source_routed(self, _sharded_sync(self, args, kwargs, "the expert gradients' "
                                                                      "tree reduction"))
                return None
            accumulation.fold_groups(self.params)
            if cp_training.cp_group() is not None:  # every CP rank holds its DP replica's whole gradient
                accumulation.reduce_over_dp_cp(self, _sharded_sync(self, args, kwargs, "the DP x CP tree reduction"),
                                               accumulation.dp_tree_order())
                return None
            if _dp_size(self) > 2:  # two ranks: one addition, whoever adds; more: the tree by moving data
                accumulation.reduce_over_dp(self, _sharded_sync(self, args, kwargs, "the tree reduction over more "
                                                                "than two DP ranks"))
                return None
        return original(self, *args, **kwargs)

    return wrapped


def forward_backward_func(original):
    def get_forward_backward_func(*args, **kwargs):
        schedule = original(*args, **kwargs)

        def forward_backward(*a, **kw):
            # forward_only (verl's compute_log_prob, evaluation): no gradient, so no plan to check and
            # nothing of a training step's accumulation (pending tied heads included) to reset
            if active() and not kw.get("forward_only", False):
                from megatron.core import parallel_state as ps

                accumulation.reset()
                # DP without CP: the CP ranks of a DP replica each hold its whole micro-batch gradients
                accumulation.set_schedule(int(kw["num_microbatches"]), ps.get_data_parallel_world_size(),
                                          ps.get_data_parallel_rank(), ACTIVE.strategy.profile.microbatch_groups)
            return schedule(*a, **kw)

        return forward_backward

    return get_forward_backward_func


def _gradients_megatron_reduces(original, model, config, args, kwargs):
    """The gradient tensors megatron's own TP all-reduce of non-tensor-parallel gradients would
    reduce: its function run with its flattening recorded and ``torch.distributed.all_reduce`` a
    no-op (every rank skips it alike), so whatever rule a megatron-core line uses is the one checked.
    None: it reduced something without flattening it first (a structure this probe does not know)."""
    module = sys.modules[original.__module__]
    flatten = getattr(module, "_flatten_dense_tensors", None)
    recorded, reduced = [], []

    def recording_flatten(tensors):
        recorded.extend(tensors)
        return flatten(tensors)

    def skipped_all_reduce(tensor, *a, **k):
        reduced.append(tensor)

    # Process-wide for the call: megatron reaches it as torch.distributed.all_reduce (the step is on
    # this thread; DDP's overlapped reductions were started, not issued, from here).
    real_all_reduce = dist.all_reduce
    if flatten is not None:
        module._flatten_dense_tensors = recording_flatten
    dist.all_reduce = skipped_all_reduce
    before = _gradient_bits(model)
    try:
        original(model, config, *args, **kwargs)
    finally:
        dist.all_reduce = real_all_reduce
        if flatten is not None:
            module._flatten_dense_tensors = flatten
    # A line that reduces through another API (a coalescing manager, all_reduce_coalesced, a process
    # group's own method) ran the real collective: the gradients changed, and the dry run says so.
    changed = [name for name, bits in _gradient_bits(model).items() if bits != before.get(name)]
    if changed:
        raise refuse("bitwise_tp_reduced_param", name=f"{changed[0]} (reduced through a collective other than "
                                                      f"torch.distributed.all_reduce, which the dry run cannot stub)")
    if reduced and not recorded:
        return None
    return recorded


def _gradient_bits(model):
    """A digest of every gradient's raw bits per parameter name (an exact integer sum of its bit
    patterns, and one of their squares' low bits: any write shows)."""
    out = {}
    for i, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            for kind, grad in (("main_grad", getattr(param, "main_grad", None)), ("grad", param.grad)):
                if grad is not None:
                    out[f"{i}.{name}.{kind}"] = _bit_sums(grad)
    return out


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements widened to int64 at a time: the whole of an LM head's gradient at once (117 M elements at
# DeepSeek-V3 dimensions) made two fresh 940 MB temporaries per tensor, twice a step (seconds of page
# faults); integer sums wrap alike in any chunking, so the digest is the same.
_BITS_CHUNK = 1 << 20


def _bit_sums(grad: torch.Tensor):
    """(sum of the bit patterns, sum of their squares mod 2^64) of ``grad``, as int64 sums."""
    bits = grad.detach().contiguous().view(-1).view(_INT_OF[grad.element_size()])
    total, squares = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    for start in range(0, bits.numel(), _BITS_CHUNK):
        piece = bits[start:start + _BITS_CHUNK].long()
        total += piece.sum()
        squares += piece.mul_(piece).sum()
    return int(total), int(squares)


def tp_norm_allreduce(original):
    def allreduce(model, config, *args, **kwargs):
        if not active():
            return original(model, config, *args, **kwargs)
        grads = _gradients_megatron_reduces(original, model, config, args, kwargs)
        if grads is None:
            raise refuse("bitwise_tp_reduced_param", name="(megatron-core reduced gradients this check cannot name)")
        storages = {g.data_ptr() for g in grads}
        for chunk in model:
            for name, param in chunk.named_parameters():
                mine = {g.data_ptr() for g in (getattr(param, "main_grad", None), param.grad) if g is not None}
                if not mine & storages:
                    continue
                if not getattr(param, PER_TOKEN_PARAM_ATTR, False):  # folded across TP in the backward
                    raise refuse("bitwise_tp_reduced_param", name=name)
                storages -= mine
        if storages:
            raise refuse("bitwise_tp_reduced_param", name="(a gradient of no parameter of the model)")
        return None

    return allreduce


def word_embedding_allreduce(original):
    def _allreduce_word_embedding_grads(model, config, *args, **kwargs):
        original(model, config, *args, **kwargs)
        if active():
            accumulation.add_tied_embeddings(model)

    return _allreduce_word_embedding_grads


def embedding_forward(original):
    """VocabParallelEmbedding.forward: under CP or with a tied weight on this stage, the weight's
    gradient by rows of its token ids (``embedding.lookup_forward``); megatron's own forward otherwise."""

    def forward(self, input_):
        if not active():
            return original(self, input_)
        return embedding.lookup_forward(self, input_, original)

    return forward


def clip_norm(original):
    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if not active() or float(norm_type) == math.inf:  # max is exact in any order
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)
        if float(norm_type) != 2.0:
            raise refuse("bitwise_clip_norm_type", value=norm_type)
        grads = [grads_for_norm] if not isinstance(grads_for_norm, (list, tuple)) else list(grads_for_norm)
        device = grads[0].device if grads else "cpu"
        group = grad_stats_parallel_group if grad_stats_parallel_group is not None else dist.group.WORLD
        return grad_norm(grads, group, device)

    return get_grad_norm_fp32


def chained_grad_norm(original):
    def get_grad_norm(self):
        """Optimizers whose norms reduce over different groups (dense and expert-parallel ones, without
        the distributed optimizer): megatron combines their rounded norms as sqrt(a^2 + b^2), which
        one device (a single optimizer) never rounds; here their exact sums add before the one rounding."""
        if not active() or len(self.chained_optimizers) == 1 or self.grads_states_parallel_group_is_shared():
            return original(self)
        total = None
        for opt in self.chained_optimizers:
            grads = compat.grads_for_grad_norm(opt)
            device = grads[0].device if grads else "cpu"
            acc = square_sums(grads, opt.get_grad_stats_parallel_group(), device)
            total = acc if total is None else total + acc.to(total.device)
        return norm_of(total)

    return get_grad_norm


def register(reg: PatchRegistry) -> None:
    why = "bitwise_training: "
    reg.register(f"{DDP}.__init__", why + "refuses models and DDP settings the mode does not cover",
                 wraps=True)(ddp_init)
    reg.register(f"{DDP}._make_backward_post_hook", why + "counts each parameter's micro-batch gradients into "
                 "canonical groups (a group's sum set aside at its end)", wraps=True)(backward_post_hook)
    reg.register(f"{BUCKETS}.start_grad_sync", why + "folds the micro-batch groups by a tree before the DP "
                 "reduction", wraps=True)(start_grad_sync)
    reg.register("megatron.core.pipeline_parallel.schedules:get_forward_backward_func", why + "checks and records "
                 "the micro-batch plan of each step", wraps=True)(forward_backward_func)
    reg.register(f"{FINALIZE}:_allreduce_non_tensor_model_parallel_grads", why + "norm gradients are already folded "
                 "across TP in the backward (no second all-reduce)", wraps=True, optional=True)(tp_norm_allreduce)
    reg.register(f"{FINALIZE}:_allreduce_layernorm_grads", why + "norm gradients are already folded across TP in "
                 "the backward (megatron-core 0.12's name)", wraps=True, optional=True)(tp_norm_allreduce)
    reg.register(f"{FINALIZE}:_allreduce_word_embedding_grads", why + "tied embeddings on one stage: the input "
                 "embedding's gradient rows, accumulated apart and DP-reduced, added once to the LM head's (as between "
                 "a pipeline's first and last stage)", wraps=True)(word_embedding_allreduce)
    reg.register("megatron.core.tensor_parallel.layers:VocabParallelEmbedding.forward", why + "the embedding's "
                 "gradient by the rows of its token ids: kept apart when the LM head shares the weight on this stage; "
                 "under context parallelism from the whole micro-batch's ids and output gradients (gathered in sequence "
                 "order)", wraps=True)(embedding_forward)
    reg.register("megatron.core.optimizer.clip_grads:get_grad_norm_fp32", why + "the clipping norm from an exact, "
                 "order-independent sum of squares", wraps=True)(clip_norm)
    reg.register("megatron.core.optimizer.optimizer:ChainedOptimizer.get_grad_norm", why + "the norm of dense and "
                 "expert-parallel optimizers from their exact sums added, rounded once", wraps=True)(chained_grad_norm)
