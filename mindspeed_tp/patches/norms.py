"""Adapter of Megatron's torch-norm wrapper: a norm module whose forward is the active strategy's
(RMSNorm / LayerNorm per token in fp32, one cast, by default).

A norm is row-local, so it is correct under sequence parallelism as it stands; its parameters
are tagged ``sequence_parallel`` so Megatron all-reduces their gradients across TP.
"""
import torch

from ..contract import refusals
from ..contract.model_config import NORMALIZATIONS
from ..contract.refusals import refuse
from ..kernels.norm import affine_norm
from ..models.marks import mark_per_token_params
from ..numerics import ACTIVE
from ..patching import PatchRegistry


class ConsistentNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, normalization: str, sequence_parallel: bool):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise refuse("normalization", value=normalization)
        self.normalization = normalization
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if normalization == "LayerNorm" else None
        for p in self.parameters():
            setattr(p, "sequence_parallel", sequence_parallel)
        mark_per_token_params(self)

    def forward(self, x):
        numerics = ACTIVE.current()
        if numerics is None:  # built under the patches, run after disable(): the fp32 norm still
            return affine_norm(x, self.weight, self.bias, self.eps, self.normalization)
        return numerics.norm(self, x)

    def extra_repr(self) -> str:
        return f"{self.normalization}, {self.normalized_shape[0]}, eps={self.eps}, fp32"


def wrapped_torch_norm_new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                           normalization="LayerNorm"):
    # The last three are megatron-core's own unused arguments (the config decides, as there; its
    # fields are checked here): taken by name so that no new one is swallowed.
    del persist_layer_norm, zero_centered_gamma, normalization
    refusals.check_config(refusals.NORM, config)
    return ConsistentNorm(
        hidden_size, eps, config.normalization, bool(getattr(config, "sequence_parallel", False))
    )


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",
        "RMSNorm/LayerNorm computed per token in fp32 with one cast (also valid under SP)",
    )(wrapped_torch_norm_new)
