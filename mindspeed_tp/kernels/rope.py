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


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, round_to_int: bool = True) -> torch.Tensor:
    """YaRN's frequencies (DeepSeek-V3's rope_type yarn) as megatron-core's YarnRotaryEmbedding
    computes them (the same ops, fp32): the plain frequencies where a dimension turns more than
    ``beta_fast`` times over the original context, those divided by ``factor`` where it turns fewer
    than ``beta_slow`` times, a linear ramp between (its ends rounded out to whole dimensions unless
    ``round_to_int`` is False: megatron's correction_range_round_to_int, transformers' truncate)."""
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaled = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def dimension_turning(turns: float) -> float:  # the dimension whose wavelength fits ``turns`` times
        return dim * math.log(original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # megatron's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep_plain = 1.0 - ramp
    return scaled * (1 - keep_plain) + plain * keep_plain


def yarn_concentration(factor: float, m: float) -> float:
    """YaRN's concentration factor 0.1 * m * ln(factor) + 1 (1 without scaling), as megatron's
    _yarn_get_mscale computes it."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_mscale(factor: float, mscale: Optional[float] = None, mscale_all_dim: Optional[float] = None) -> float:
    """The factor YaRN multiplies cos and sin by: the concentration of ``mscale`` over that of
    ``mscale_all_dim`` (1.0 for DeepSeek-V3, whose two are equal; its softmax scale carries the
    square of the second instead: ``mla_softmax_scale``)."""
    if mscale is None or mscale_all_dim is None:
        return yarn_concentration(factor, 1.0)
    return float(yarn_concentration(factor, mscale) / yarn_concentration(factor, mscale_all_dim))


def mla_softmax_scale(head_dim: int, factor: float, mscale_all_dim: float) -> float:
    """Megatron's MLA softmax scale m * m / sqrt(query/key head) with m YaRN's concentration of
    ``mscale_all_dim`` (computed whatever the rope type: 1 when mscale_all_dim is 0 or factor <= 1)."""
    m = yarn_concentration(factor, mscale_all_dim)
    return m * m / math.sqrt(head_dim)


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


def apply_rope(t: torch.Tensor, angles: torch.Tensor, interleaved: bool = False, deinterleave: bool = False,
               mscale: float = 1.0) -> torch.Tensor:
    """Rotate the first ``angles.shape[-1]`` channels of ``t``; angles broadcast against ``t``.
    ``deinterleave`` (multi-latent attention, megatron's and DeepSeek's interleaved rope channels):
    the even channels, then the odd ones, rotated by halves, in that (half) layout. ``mscale``
    (YaRN): cos and sin multiplied by it in fp32 first."""
    rot = angles.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    tf = t_rot.float()
    if deinterleave:
        tf = torch.cat((tf[..., 0::2], tf[..., 1::2]), dim=-1)
    angles = angles.float()
    c, s = cos(angles), sin(angles)
    if mscale != 1.0:
        c, s = c * mscale, s * mscale
    out = tf * c + _rotate_half(tf, interleaved) * s
    return torch.cat((out.to(t.dtype), t_pass), dim=-1)
