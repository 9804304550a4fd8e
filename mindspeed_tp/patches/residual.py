"""Patch of Megatron's bias-dropout-add under a real-engine profile (vllm-cpu): the residual
stream as the engine's fused-add RMSNorm carries it (integrations/vllm/forward.py). Other profiles
run Megatron's own function."""
from .. import state
from ..patching import PatchRegistry


def _vllm():
    """The real-engine pieces (vllm-cpu profiles), imported when first used."""
    from ..integrations.vllm import forward

    return forward


def bias_dropout_add(original):
    def _bias_dropout_add_func(x_with_bias, residual, prob, training):
        if state.enabled() and state.profile().engine_name == "vllm":
            return _vllm().residual_add(x_with_bias, residual, prob, training)
        return original(x_with_bias, residual, prob, training)

    return _bias_dropout_add_func


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.fusions.fused_bias_dropout:_bias_dropout_add_func",
        "vllm-cpu profiles: the residual add in fp32 on the rounded residual, the unrounded sum kept for the "
        "next norm (the engine's fused-add RMSNorm); other profiles unchanged",
        wraps=True,
    )(bias_dropout_add)
