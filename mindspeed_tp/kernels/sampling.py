"""The sampling transforms a compared logprob goes through (``contract.sampling``), as engines apply them.

- ``divide_by_temperature``: fp32 logits divided by an fp32 tensor holding T, as vLLM's
  ``Sampler.apply_temperature`` (``logits.div_(temp.unsqueeze(1))``). Never by a Python scalar:
  CUDA turns a division by a CPU scalar into a multiplication by its reciprocal (other bits).
- ``top_k_top_p_rows``: the reference engine's top-k / top-p mask of full-vocab rows, vLLM's CPU
  algorithm op for op (``apply_top_k_top_p_pytorch``): top-k alone by the k-th largest value;
  with top-p, the raw row sorted ascending once with torch's default (unstable) sort, as vLLM
  sorts, the top-k threshold and the cumulative softmax <= 1 - p dropped in that order, the
  largest always kept. Tied logits (frequent in bf16) at the cut are kept or dropped by that sort's
  order: a stable sort, or a sort of the row after the top-k mask, drops other tokens of the tie
  (measured: most rows at a 151936 vocabulary). Every step is row-local (a row's mask depends on
  that row alone), so one engine row and thousands of training rows get the same mask.
- ``mask_dropped_vocab``: this rank's vocab shard with -inf where the full row's mask drops a
  column (rows gathered over the vocab-parallel group in token chunks).
"""
from typing import Callable

import torch

from .collectives import gather_along_rank, group_rank, group_size

# Tokens per gather when a vocab shard is masked: bounds the full-row buffer to chunk x V per rank.
MASK_CHUNK_TOKENS = 256


def divide_by_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``logits / T`` (a new tensor; T = 1 returns the fp32 logits)."""
    lf = logits.float()
    if temperature == 1.0:
        return lf
    t = torch.full((1,) * lf.dim(), float(temperature), dtype=torch.float32, device=lf.device)
    return torch.div(lf, t)


def top_k_top_p_rows(rows: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``rows`` (n, V) fp32 (already divided by T) with -inf where top-k / top-p drop a column
    (a new tensor). top_k 0 and top_p 1: off."""
    top_k = int(top_k) if top_k and top_k < rows.shape[-1] else 0
    if top_p >= 1.0:
        out = rows.clone()
        if top_k:  # vLLM's top-k alone: no sort, the k-th largest value (ties at it all kept)
            kth = rows.topk(top_k, dim=-1).values[..., -1:]
            out.masked_fill_(rows < kth, float("-inf"))
        return out
    ordered, index = rows.sort(dim=-1, descending=False)  # vLLM's sort call: its tie order
    if top_k:
        kth = ordered[..., rows.shape[-1] - top_k:rows.shape[-1] - top_k + 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    p = torch.full((1,), float(top_p), dtype=torch.float32, device=rows.device)
    drop = cumulative <= 1 - p
    drop[..., -1] = False  # the largest is always kept
    return rows.clone().scatter(-1, index, ordered.masked_fill(drop, float("-inf")))


def reference_mask(sampling) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference engine's mask of full real-vocab rows for a ``contract.sampling.Sampling``."""
    return lambda rows: top_k_top_p_rows(rows, sampling.top_k, sampling.top_p)


def mask_dropped_vocab(shard: torch.Tensor, group, vocab_size: int,
                       mask_rows: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``shard`` (..., V/TP, this rank's columns of fp32 logits / T) with -inf where ``mask_rows``
    drops a column of the full real-vocab row; differentiable (a dropped column's gradient is 0)."""
    world, v_local = group_size(group), shard.shape[-1]
    start = group_rank(group) * v_local
    flat = shard.detach().reshape(-1, v_local)
    drop = torch.zeros(flat.shape, dtype=torch.bool, device=shard.device)
    for i in range(0, flat.shape[0], MASK_CHUNK_TOKENS):
        rows = flat[i:i + MASK_CHUNK_TOKENS]
        full = gather_along_rank(rows, group).permute(1, 0, 2).reshape(rows.shape[0], world * v_local)
        real = full[:, :vocab_size].contiguous()
        kept = torch.isfinite(mask_rows(real)) | ~torch.isfinite(real)
        mine = kept[:, start:start + v_local]
        drop[i:i + rows.shape[0], :mine.shape[1]] = ~mine
    return shard.masked_fill(drop.reshape(shard.shape), float("-inf"))
