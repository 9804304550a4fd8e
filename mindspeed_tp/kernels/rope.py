"""Rotary position embedding in fp32 from absolute-position angles, one cast at the end.

Training and the decode path both call ``rope_angles`` and ``apply_rope``, so a token's rotation
does not depend on how the sequence was chunked.
"""
import math
from typing import Optional

import torch

from .elementwise import cos, sin


def rope_inv_freq(dim: int, base: float, llama3_factor: Optional[float] = None) -> torch.Tensor:
    """Megatron's RotaryEmbedding.inv_freq (the same ops), Llama-3-scaled by ``llama3_factor`` if set."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return inv_freq if llama3_factor is None else llama3_scaled(inv_freq, llama3_factor)


def llama3_scaled(freqs: torch.Tensor, factor: float, low_freq_factor: float = 1, high_freq_factor: float = 4,
                  original_max_position_embeddings: int = 8192) -> torch.Tensor:
    """Llama-3's RoPE scaling op for op as megatron-core's RotaryEmbedding._apply_scaling computes it
    (the same bits): long wavelengths divided by ``factor``, the band between interpolated."""
    old_context_len = original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    inv_freq = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq)


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
