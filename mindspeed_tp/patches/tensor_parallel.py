"""Adapters of megatron.core.tensor_parallel: megatron's arguments checked, then the active
numerics strategy's column / row-parallel linear and logprob (``numerics/``)."""
from .. import compat, state
from ..contract.refusals import refuse
from ..kernels.collectives import group_size
from ..numerics import ACTIVE
from ..models.marks import config_true_vocab, true_vocab_of
from ..numerics.vocab import true_vocab_size
from ..patching import PatchRegistry

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

    The GEMM is the active strategy's (``column_linear``).
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
    return ACTIVE.strategy.column_linear(input, weight, bias, group, bool(sequence_parallel), bool(allreduce_dgrad))


def row_parallel_forward(self, input_):
    """RowParallelLinear.forward: the K reduction as the active strategy orders it (the canonical
    tree; the rollout engine's partials), never the collective library's own sum."""
    numerics = ACTIVE.strategy
    group = compat.tp_group_of(self)
    numerics.profile.check_tp(group_size(group))
    if not self.input_is_parallel:
        input_ = compat.scatter_to_tensor_model_parallel_region(input_, group)
    if getattr(self, "explicit_expert_comm", False):
        raise refuse("explicit_expert_comm")
    return numerics.row_linear(self, input_, group)


def column_parallel_forward(original):
    """Run the LM head (marked at GPTModel construction) with fp32 output: logits in fp32."""

    def forward(self, *args, **kwargs):
        if getattr(self, "_mindspeed_tp_logits", False):
            # The model's true vocab (its mark or config, models/marks.py) for the bitwise backward's
            # vocab leaves; the loss patch reads it again under compute_language_model_loss.
            vocab = state.model_vocab() or config_true_vocab(getattr(self, "config", None), self.output_size)
            with state.fp32_output(), state.model_vocab_size(vocab):
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return forward


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    """-logprob by the active strategy (the canonical vocab tree; the engine's full-vocab
    log-softmax), fp32. Padded vocab columns (ids >= the true vocab size, see ``true_vocab_size``)
    are excluded exactly. tp_group: the tensor-parallel group (megatron-core >= 0.19 passes it;
    default: the global one)."""
    if label_smoothing:
        raise refuse("label_smoothing")
    numerics = ACTIVE.strategy
    group = tp_group if tp_group is not None else compat.tp_group_of()
    vocab_size = true_vocab_size(vocab_parallel_logits.shape[-1] * group_size(group))
    return -numerics.logprob(vocab_parallel_logits, target, group, vocab_size)


def language_model_loss(original):
    """LanguageModule.compute_language_model_loss with the model's true vocab size (its mark, or its
    config's ``vocab_size`` on Megatron-Bridge providers) known to the cross-entropy patch."""

    def compute_language_model_loss(self, labels, logits):
        with state.model_vocab_size(true_vocab_of(self) or state.model_vocab()):
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
