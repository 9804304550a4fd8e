"""Stand-in features on targets mindspeed-tp also patches (names and flags as in MindSpeed)."""
from mindspeed.features_manager.feature import MindSpeedFeature
from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager


def _lost(what):
    def replacement(*args, **kwargs):
        raise RuntimeError(f"MindSpeed stand-in {what} ran: mindspeed-tp's patch of the same target lost")

    return replacement


class StandinNorm:
    """Like MindSpeed's PTNorm: a class put under megatron's WrappedTorchNorm / LNImpl names."""

    def __new__(cls, config, hidden_size, eps=1e-5):
        raise RuntimeError("MindSpeed stand-in PTNorm ran: mindspeed-tp's norm patch lost")


class MegatronBasicFeature(MindSpeedFeature):
    def __init__(self):
        super().__init__("megatron-basic", optimization_level=0)

    def register_args(self, parser):
        parser.add_argument("--use-fused-rmsnorm", action="store_true")

    def register_patches(self, pm, args):
        pm.register_patch("megatron.core.transformer.torch_norm.WrappedTorchNorm", StandinNorm)
        pm.register_patch("megatron.core.models.gpt.gpt_layer_specs.LNImpl", StandinNorm)

        def vocab_parallel_cross_entropy_wrapper(fn):
            return _lost("cross-entropy wrapper")

        pm.register_patch("megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy",
                          vocab_parallel_cross_entropy_wrapper)


class FlashAttentionFeature(MindSpeedFeature):
    def __init__(self):
        super().__init__("use-flash-attn", optimization_level=0)

    def register_args(self, parser):
        parser.add_argument("--use-flash-attn", action="store_true")

    def register_patches(self, pm, args):
        if getattr(args, "use_flash_attn", False):
            pm.register_patch("megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
                              _lost("flash attention"))


class MC2Feature(MindSpeedFeature):
    def __init__(self):
        super().__init__("use-ascend-mc2", optimization_level=2)

    def register_args(self, parser):
        parser.add_argument("--use-ascend-mc2", action="store_true")

    def register_patches(self, pm, args):
        pm.register_patch("megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce",
                          _lost("MC2 linear"))


MindSpeedFeaturesManager.set_features_list([MegatronBasicFeature(), FlashAttentionFeature(), MC2Feature()])
