"""Consistent attention: one per-query procedure for training, chunked prefill and paged decode.

The procedure (fp32 scores, key blocks aligned to absolute positions, fp32 online softmax,
invisible keys excluded by select) is each backend's ``attention`` / ``decode_attention``
primitive; the torch reference (``backends/torch.py``) states it in code.
"""
from typing import Optional

import torch

from . import dispatch


def consistent_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = True,
    q_positions: Optional[torch.Tensor] = None,
    excluded: Optional[torch.Tensor] = None,
    block_size: int = 128,
    row_multiple: int = 16,
    split_size: Optional[int] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention for q (b, hq, sq, d) over k, v (b, hkv, sk, d); returns (b, hq, sq, d).

    q_positions: absolute position of each query (default: the last ``sq`` key positions).
    excluded: optional bool mask broadcastable to (b, 1, sq, sk); True hides a key from a query.
    split_size: if set (a multiple of block_size), keys are processed in fixed splits aligned to
    absolute positions, each with its own online softmax, merged in split order (what split-KV
    decode kernels do); every mode must then use the same split size.
    window: sliding-window attention, a query sees the keys at most ``window`` positions before it
    (megatron-core's window_size (window, 0); a Hugging Face sliding_window of window + 1).
    sinks: attention sinks (hq,), a logit per head in every query's softmax denominator with no value
    (megatron-core's softmax_type learnable / off-by-one, gpt-oss' ``sinks``): joined to the softmax
    state once, after the last key block, so every mode gets the same bits.
    """
    attend = dispatch.kernel("attention", q)
    return attend(q, k, v, scale, causal, q_positions, excluded, block_size, row_multiple, split_size, window, sinks)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    block_size: int = 128,
    row_multiple: int = 16,
    split_size: Optional[int] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of the newest queries over a paged KV cache (the rollout decode step).

    q (b, hq, sq, d): the last sq tokens of each request; k_cache/v_cache (num_pages, page_size,
    hkv, d); page_table (b, pages per request) page ids in order; cache_seqlens (b,) keys held per
    request, the new tokens included. Returns (b, hq, sq, d), bitwise what ``consistent_attention``
    gives for the same queries (torch backend; the npu backend calls the v3
    ``flash_attn_with_kvcache`` with num_splits=1).
    """
    decode = dispatch.kernel("decode_attention", q)
    return decode(q, k_cache, v_cache, cache_seqlens, page_table, scale, block_size, row_multiple, split_size,
                  window, sinks)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens,
    scale: float,
    causal: bool = True,
    block_size: int = 128,
    row_multiple: int = 16,
    split_size: Optional[int] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over packed (thd) sequences: q (t, hq, d), k, v (t, hkv, d), sequence i in rows
    cu_seqlens[i]:cu_seqlens[i+1] (a list of ints). Each sequence attends over its own keys only,
    as its own ``consistent_attention`` call, so its key blocks are aligned to its own positions
    0, B, 2B, ... -- the bits of the same sequence scored padded (bshd). Returns (t, hq, d)."""
    outs = []
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if stop == start:
            continue
        one = [x[start:stop].permute(1, 0, 2).unsqueeze(0) for x in (q, k, v)]  # (1, h, len, d)
        out = consistent_attention(*one, scale=scale, causal=causal, block_size=block_size,
                                   row_multiple=row_multiple, split_size=split_size, window=window, sinks=sinks)
        outs.append(out.squeeze(0).permute(1, 0, 2))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(*q.shape[:-1], v.shape[-1])
