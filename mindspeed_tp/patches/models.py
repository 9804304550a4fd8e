"""Patch of GPTModel construction: mark the LM head so its logits come out in fp32."""
from ..patching import PatchRegistry


def gpt_model_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        head = getattr(self, "output_layer", None)
        if head is not None:
            head._mindspeed_tp_logits = True

    return __init__


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.models.gpt.gpt_model:GPTModel.__init__",
        "marks output_layer so the LM head GEMM returns fp32 logits",
        wraps=True,
    )(gpt_model_init)
