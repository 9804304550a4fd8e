"""The npu kernel backend: the kernel interface through CANN's batch-invariant ops and the Ascend
consistent flash-attention kernels. The torch kernels call into here when ``backends.use_npu``
says so; these functions only shape the calls. That a row's result does not depend on the rows
computed with it is the kernels' promise, verified on an NPU (README, "Ascend").

Signatures used (sources named in ``mindspeed_tp/backends/npu.py``):

- ``npu_mm_batch_invariant(a, b)`` (2-D), ``npu_matmul_batch_invariant(a, b)`` (batched);
- ``npu_reduce_sum_batch_invariant(x, dim, keepdim)``, called with the last dim only (MindSpeed's
  adapter permutes other dims to the end before calling it);
- ``npu_log_softmax_batch_invariant(x, dim)``;
- ``flash_attn_npu.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
  return_attn_probs=False)``, q/k/v (batch, seqlen, heads, head_dim);
- ``flash_attn_npu_v3.flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None,
  rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
  page_table=None, ..., softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0,
  softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=0, pack_gqa=None,
  sm_margin=0, return_softmax_lse=False)``, paged cache (num_pages, page_size, kv_heads, head_dim).

The attention parameters are the ones that keep training and decode on one procedure: no dropout,
no sliding window (-1, -1), no softcap, no ALiBi, causal or no mask, and ``num_splits=1`` (one
split: the decode kernel does not choose a split-KV count by batch size).

GEMM inputs are given in fp32 so that the products of bf16 values are exact and the partial sums
stay fp32 (row-parallel leaves are folded before the one cast); that the ops accept fp32 is for an
NPU run to confirm (README, "Ascend").
"""
from typing import Optional

import torch

from ..errors import ConfigError


def _ops():
    from ..backends.npu import load

    return load()


def _mm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ops = _ops()
    if a.dim() == 2 and b.dim() == 2:
        return ops.mm(a.contiguous(), b.contiguous())
    return ops.matmul(a.contiguous(), b.contiguous())


class _BatchInvariantMatmul(torch.autograd.Function):
    """a @ b through the batch-invariant ops, also for the gradients (batch-invariant backward)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _mm_op(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = _mm_op(grad, b.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        grad_b = _mm_op(a.transpose(-1, -2), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``a @ b`` for a (..., M, K) and b (K, N) or b with a's leading dims (..., K, N)."""
    a, b = a.float(), b.float()
    if b.dim() == 2 and a.dim() > 2:
        lead = a.shape[:-1]
        return _BatchInvariantMatmul.apply(a.reshape(-1, a.shape[-1]), b).reshape(*lead, b.shape[-1])
    if b.dim() != 2 and a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"npu matmul: leading dims of {tuple(a.shape)} and {tuple(b.shape)} must match")
    return _BatchInvariantMatmul.apply(a, b)


class _RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keepdim):
        ctx.shape, ctx.keepdim = x.shape, keepdim
        return _ops().reduce_sum(x.contiguous(), x.dim() - 1, keepdim)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.keepdim:
            grad = grad.unsqueeze(-1)
        return grad.expand(ctx.shape), None


def row_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Sum over the last dim through the batch-invariant reduce."""
    return _RowSum.apply(x, keepdim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Row log-softmax through the batch-invariant op (no autograd: routing and sampling only)."""
    return _ops().log_softmax(x.contiguous(), dim if dim >= 0 else x.dim() + dim)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    q_positions: Optional[torch.Tensor] = None,
    excluded: Optional[torch.Tensor] = None,
    split_size: Optional[int] = None,
) -> torch.Tensor:
    """Training / prefill attention through ``flash_attn_npu.flash_attn_func``.

    q (b, hq, sq, d), k/v (b, hkv, sk, d) -> (b, hq, sq, d). The kernel's causal mask is
    bottom-right aligned, i.e. queries are the last sq key positions.
    """
    if excluded is not None:
        raise ConfigError("the npu backend's attention supports causal or no-mask attention only (flash_attn_npu "
                          "takes no explicit mask): use attn_mask_type causal without padding masks")
    if split_size is not None:
        raise ConfigError("profile field 'attention_split_size' must be empty with the npu backend (num_splits=1)")
    sq, sk = q.shape[2], k.shape[2]
    if q_positions is not None and not torch.equal(q_positions.cpu(), torch.arange(sk - sq, sk)):
        raise ConfigError("the npu backend's attention needs queries at the last key positions (bottom-right "
                          "causal alignment); chunked prefill must read all of the request's keys so far")
    out = _ops().flash_attn_func(
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=True,  # a fixed-order backward too (the forward is deterministic either way)
        return_attn_probs=False,
    )
    return out.transpose(1, 2)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode over a paged KV cache through the v3 ``flash_attn_with_kvcache``; see
    ``kernels.attention.decode_attention`` for the shapes."""
    out = _ops().flash_attn_with_kvcache(
        q.transpose(1, 2).contiguous(),
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens.to(torch.int32),
        page_table=page_table.to(torch.int32),
        softmax_scale=scale,
        causal=True,
        window_size=(-1, -1),
        softcap=0.0,
        num_splits=1,
        return_softmax_lse=False,
    )
    return out.transpose(1, 2)
