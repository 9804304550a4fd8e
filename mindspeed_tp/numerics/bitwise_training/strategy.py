"""The bitwise-training strategy (profile ``bitwise_training: true``): the backward pass and the
optimizer step in canonical order too, so every layout gives the same gradients, parameters and
optimizer state after each step (docs/CONTRACT.md, section 9; the math: the modules beside this one).

Its megatron-core patch entries (DDP, schedules, finalize, clipping, the embedding): ``patches.py``.
"""
import torch

from ... import compat, state
from ...contract.refusals import refuse
from ...devices import machine_device_type
from ...kernels import dispatch, invariant_linear
from ...kernels.collectives import group_size
from ...kernels.norm import normalized
from .. import ACTIVE
from ..canonical.strategy import CanonicalTree, check_expert_bias
from ..vocab import true_vocab_size
from . import column_parallel, experts, token_sums
from . import context_parallel as cp_training


class BitwiseTraining(CanonicalTree):
    """The canonical tree's forward; the backward in canonical order too: the invariant GEMMs for
    dx and dW, column-parallel input gradients by canonical leaves folded by moving data, per-token
    parameter gradients as canonical token sums; the micro-batch and DP accumulation and the
    clipping norm by the mode's patch entries (``patches.py``)."""

    name = "bitwise_training"

    def __init__(self, profile):
        super().__init__(profile)
        self.backward = cp_training.WholeSequenceBackward(self.row_multiple)

    def check_context_parallel(self, packed: bool = False) -> None:
        """Padded (bshd) CP batches are covered; packed (thd) ones not yet: a rank's tokens of each
        packed sequence are not mapped back to their global rows."""
        if packed:
            raise refuse("bitwise_context_parallel")

    def cp_gather(self, x, total, group):
        """The whole sequence on every CP rank; backward: this rank's rows of a gradient computed
        whole on every rank (nothing summed)."""
        return cp_training.whole_sequence(x, group)

    def cp_attention(self, module, query, key_full, value_full, attention_mask, mask_name, causal, q_positions):
        """The one-device attention on the whole sequence's queries (and mask rows), gathered by moving
        data, then this rank's rows: its backward gets the whole output gradient by an all-gather, so
        dK/dV are folded over the query tiles in the one-device order on every CP rank."""
        group = cp_training.cp_group()
        query_full = cp_training.whole_sequence(query, group)
        if attention_mask is not None and attention_mask.shape[-2] == query.shape[0]:
            attention_mask = cp_training.gather_rows(attention_mask, group, dim=-2)
        out = self.attention(module, query_full, key_full, value_full, attention_mask, mask_name, causal)
        return cp_training.this_ranks_rows(out, group)

    def check_ready(self) -> None:
        """Only where it was verified: the torch backend, the one CPUs run."""
        device = machine_device_type()
        backend = dispatch.backend_for_device(device, self.profile.backend)
        if backend != "torch" or device in dispatch.NOT_INVARIANT_ON["torch"]:
            raise refuse("bitwise_training_backend", backend=backend, device=device)

    def column_linear(self, input, weight, bias, group, sequence_parallel, allreduce_dgrad):
        """The SP gather and the dgrad sum inside one function whose input gradient is folded in
        canonical order (``column_parallel.py``)."""
        logits = state.want_fp32_output()
        out_dtype = torch.float32 if logits else input.dtype
        vocab = true_vocab_size(weight.shape[0] * group_size(group)) if logits else None
        # The gradient is summed over TP when the input is shared (SP gather or replicated input).
        reduce_group = group if (sequence_parallel or allreduce_dgrad) else None
        row_multiple = self.row_multiple

        def compute(x2d, w, dtype):
            return dispatch.kernel("linear", x2d)(x2d, w, dtype, row_multiple)

        return column_parallel.column_linear(input, weight, reduce_group, sequence_parallel, out_dtype, compute,
                                             self.profile, vocab, bias)

    def add_bias(self, x, bias, sequence_split):
        """The bias's gradient as a canonical token sum (``token_sums.add_bias``)."""
        return token_sums.add_bias(x, bias, sequence_split, compat.tp_group_of(), self.profile.canonical_shards)

    # ------------------------------------------------------------------ MoE (experts.py)
    def router_logits(self, h, weight, bias, config):
        """dW over the whole micro-batch's tokens (SP slices gathered), the same on every TP rank."""
        rm = self.row_multiple

        def compute(x, w, b):
            return invariant_linear(x, w, b, out_dtype=torch.float32, row_multiple=rm)

        return experts.RouterLogits.apply(h, weight, bias, compat.tp_group_of(), bool(config.sequence_parallel),
                                          compute, rm)

    def router_losses(self, router, logits, padding_mask):
        """The router losses' gradients at one device's scale (``experts.router_losses``)."""
        from megatron.core import parallel_state as ps

        return experts.router_losses(router, logits, padding_mask, ps.get_tensor_and_context_parallel_group())

    def moe_dispatch(self, h, plan, group, k):
        """Backward: a token's slot gradients from the owner ranks, summed in slot order."""
        return list(experts.CanonicalDispatch.apply(h, plan, group, k).split(plan.expert_counts))

    def expert_rows(self, plan, group, local_experts):
        """Each expert's rows by micro-batch (``experts.expert_rows``)."""
        expert_buffers = {not getattr(e.linear_fc1.weight, "allreduce", True) for e in local_experts}
        if len(expert_buffers) != 1:
            raise RuntimeError("bitwise_training: the local experts of one layer are in different gradient buffers")
        return experts.expert_rows(plan, group, expert_buffers.pop())

    def _expert_leaves(self, n_local, etp_group, parts):
        leaves = self.profile.canonical_shards // group_size(etp_group)
        if n_local % (parts * leaves):
            raise refuse("bitwise_column_indivisible", n=n_local * group_size(etp_group), parts=parts,
                         c=self.profile.canonical_shards)
        return leaves

    def expert_up_proj(self, x, weight, bias, etp_group, gated, rows, product=None):
        """dx by canonical leaves folded across expert TP; dW (and the bias's gradient) per micro-batch
        (``product``: the forward GEMM's value, computed already)."""
        parts = 2 if gated else 1
        rm = self.row_multiple

        def compute(a, w):
            return invariant_linear(a, w, row_multiple=rm) if product is None else product

        out = experts.ExpertUpProj.apply(x, weight, etp_group, self._expert_leaves(weight.shape[0], etp_group, parts),
                                         parts, rows, compute, rm)
        return out if bias is None else experts.ExpertBias.apply(out, bias, rows, rm)

    def expert_down_proj(self, a, weight, bias, etp_group, dtype, rows):
        """The canonical fold across expert TP, then the bias (expert TP 1); dW and the bias's gradient
        per micro-batch, the owner's gradient moved back."""
        check_expert_bias(bias, etp_group)
        leaves = self.profile.canonical_shards // group_size(etp_group)
        partial = experts.ExpertDownProjLeaves.apply(a, weight, leaves, rows, self.row_multiple)
        out = experts.FoldToOwner.apply(partial, etp_group, dtype)
        return out if bias is None else experts.ExpertBias.apply(out, bias, rows, self.row_multiple)

    def expert_down_projs(self, acts, weights, biases, etp_group, dtypes, rows):
        """Every local expert's ``expert_down_proj``, the leaves' dx of all of them computed together in
        backward (``experts.ExpertDownProjLeavesTogether``)."""
        for bias in biases:
            check_expert_bias(bias, etp_group)
        if not acts:
            return []
        leaves = self.profile.canonical_shards // group_size(etp_group)
        partials = experts.ExpertDownProjLeavesTogether.apply(leaves, rows, self.row_multiple, len(acts), *acts,
                                                              *weights)
        outs = [experts.FoldToOwner.apply(p, etp_group, dtype) for p, dtype in zip(partials, dtypes)]
        return [out if bias is None else experts.ExpertBias.apply(out, bias, r, self.row_multiple)
                for out, bias, r in zip(outs, biases, rows)]

    def norm(self, module, x):
        """Parameter gradients as canonical token sums (``token_sums``)."""
        x_hat = normalized(x, module.eps, module.normalization)
        seq_parallel = getattr(module.weight, "sequence_parallel", False)
        return token_sums.scale(x_hat, module.weight, module.bias, seq_parallel, compat.tp_group_of(),
                                self.profile.canonical_shards).to(x.dtype)


def active() -> bool:
    """True while the patches are on under this strategy."""
    return isinstance(ACTIVE.current(), BitwiseTraining)

