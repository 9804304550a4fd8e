"""Patch of GPTModel construction: mark the LM head for fp32 logits, and refuse models built from
modules the patch set does not cover (instead of silently running them non-invariantly)."""
from ..errors import ConfigError
from ..patching import PatchRegistry

# Module families whose numerics no patch here controls, with the setting that avoids them.
_UNCOVERED = (
    ("megatron.core.extensions.transformer_engine", "Transformer Engine modules",
     "build the model with the local spec (--transformer-impl local)"),
    ("apex.", "apex fused norms", "use normalization=RMSNorm (torch norm path) or uninstall apex"),
    # What megatron-core's local spec builds for LayerNorm when apex imports (GPU installs): the
    # class lives in megatron's namespace, the arithmetic is apex's kernel.
    ("megatron.core.fusions.fused_layer_norm", "megatron-core's apex-backed fused norm",
     "build the norms as megatron.core.transformer.torch_norm.WrappedTorchNorm, which mindspeed-tp patches "
     "(normalization=RMSNorm, a layer spec naming WrappedTorchNorm, or uninstall apex)"),
    # MindSpeed puts these under megatron's TE names (TEColumnParallelLinear, TEDotProductAttention, ...)
    ("mindspeed.te.", "MindSpeed's Transformer Engine replacements",
     "build the model with the local spec (--transformer-impl local; under verl the mindspeed_tp.verl entry does)"),
)
_UNCOVERED_CLASSES = {
    "GroupedMLP": "grouped-GEMM experts are not covered (moe_grouped_gemm=False)",
    "MLASelfAttention": "multi-latent attention is not supported (multi_latent_attention=False)",
}


def validate_model_modules(model) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "cross_entropy_loss_fusion", False):
        raise ConfigError("cross_entropy_loss_fusion must be False with --true-on-policy (the fused kernel "
                          "bypasses the canonical vocab reduction)")
    for name, module in model.named_modules():
        cls = type(module)
        for prefix, what, fix in _UNCOVERED:
            if cls.__module__.startswith(prefix):
                raise ConfigError(f"{name or 'model'} is a {cls.__name__} ({what}), which mindspeed-tp does not "
                                  f"make layout-invariant: {fix}")
        if cls.__name__ in _UNCOVERED_CLASSES:
            raise ConfigError(f"{name}: {_UNCOVERED_CLASSES[cls.__name__]}")


def check_not_displaced() -> None:
    """Refuse to build a model while another patcher holds some of our targets: MindSpeed's patch
    manager, imported or re-applied (``repatch``) after mindspeed-tp, rebinds the same names."""
    from . import registry

    displaced = [p.target for p in registry().displaced()]
    if displaced:
        raise ConfigError(
            f"mindspeed-tp patches were replaced after they were enabled ({', '.join(displaced)}), e.g. by "
            f"mindspeed.megatron_adaptor imported or MindSpeed's repatch() run afterwards: import "
            f"mindspeed_tp.megatron_adaptor after mindspeed.megatron_adaptor, or call mindspeed_tp.enable() "
            f"again after repatch()"
        )


def gpt_model_init(original):
    def __init__(self, *args, **kwargs):
        check_not_displaced()
        original(self, *args, **kwargs)
        validate_model_modules(self)
        head = getattr(self, "output_layer", None)
        if head is not None:
            head._mindspeed_tp_logits = True

    return __init__


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.models.gpt.gpt_model:GPTModel.__init__",
        "marks output_layer so the LM head GEMM returns fp32 logits; rejects modules no patch covers "
        "(Transformer Engine, apex norms incl. megatron's FusedLayerNorm, grouped-GEMM experts, MLA)",
        wraps=True,
    )(gpt_model_init)
