"""Per-token norms in fp32 with one cast at the end (row-local, so layout cannot change them)."""
from typing import Optional

import torch

from . import dispatch


def _row_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim, keepdim, in the backend's fixed per-row order."""
    return dispatch.kernel("row_mean", x)(x)


def normalized(x: torch.Tensor, eps: float, normalization: str = "RMSNorm") -> torch.Tensor:
    """The fp32 normalized tokens, before the affine step (RMSNorm or LayerNorm)."""
    xf = x.float()
    if normalization == "RMSNorm":
        return xf * torch.rsqrt(_row_mean(xf.pow(2)) + eps)
    centered = xf - _row_mean(xf)
    return centered * torch.rsqrt(_row_mean(centered.pow(2)) + eps)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    y = normalized(x, eps, "RMSNorm")
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    y = normalized(x, eps, "LayerNorm")
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def affine_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                normalization: str) -> torch.Tensor:
    """RMSNorm (``bias`` unused) or LayerNorm, by name."""
    if normalization == "RMSNorm":
        return rms_norm(x, weight, eps)
    return layer_norm(x, weight, bias, eps)
