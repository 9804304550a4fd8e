"""Patch of Megatron's torch-norm wrapper: RMSNorm / LayerNorm per token in fp32, one cast.

A norm is row-local, so it is correct under sequence parallelism as it stands; its parameters
are tagged ``sequence_parallel`` so Megatron all-reduces their gradients across TP.
"""
import torch

from ..contract import refusals
from ..contract.refusals import refuse
from ..kernels import layer_norm, rms_norm
from ..patching import PatchRegistry


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

    def forward(self, x):
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
