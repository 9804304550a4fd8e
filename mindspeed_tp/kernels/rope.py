"""Rotary position embedding in fp32 from absolute-position angles, one cast at the end.

Training and the decode path both call ``rope_angles`` and ``apply_rope``, so a token's rotation
does not depend on how the sequence was chunked.
"""
import torch

from .elementwise import cos, sin


def rope_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angles (len(positions), dim) laid out as [freqs, freqs] (non-interleaved)."""
    freqs = torch.outer(positions.to(torch.float32), inv_freq.float())
    return torch.cat((freqs, freqs), dim=-1)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(t: torch.Tensor, angles: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``angles.shape[-1]`` channels of ``t``; angles broadcast against ``t``."""
    rot = angles.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    tf = t_rot.float()
    angles = angles.float()
    out = tf * cos(angles) + _rotate_half(tf, interleaved) * sin(angles)
    return torch.cat((out.to(t.dtype), t_pass), dim=-1)
