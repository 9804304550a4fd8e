"""The npu kernel backend: the primitive kernels (``kernels/dispatch.py``) through CANN's
batch-invariant ops and the Ascend consistent flash-attention kernels; these functions only shape
the calls. That a row's result does not depend on the rows
computed with it is the kernels' promise, verified on an NPU (docs/DEVICES.md, "Ascend").

Signatures used (the CANN and MindSpeed sources they come from: docs/DEVICES.md, "Ascend"):

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
NPU run to confirm (docs/DEVICES.md, "Ascend").
"""
from typing import Optional

import torch

from ...devices import npu_runtime
from ...contract.refusals import refuse

# The Ascend flash-attention kernels take causal or no mask, nothing explicit (as MindSpeed's
# flash_attn_npu adaptor): the attention patch drops Megatron's causal mask tensor for them.
EXPLICIT_MASKS = False


def prepare(profile) -> None:
    """enable(): load the Ascend packages and fix the collective environment."""
    npu_runtime.prepare()


def _mm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ops = npu_runtime.load()
    if a.dim() == 2 and b.dim() == 2:
        return ops.mm(a.contiguous(), b.contiguous())
    return ops.matmul(a.contiguous(), b.contiguous())


def matmul(a: torch.Tensor, b: torch.Tensor, row_multiple: int = 16) -> torch.Tensor:
    """fp32 ``a @ b`` for a (..., M, K) and b (K, N) or b with a's leading dims (..., K, N);
    ``row_multiple`` does not apply (the ops tile by themselves)."""
    a, b = a.float(), b.float()
    if b.dim() == 2 and a.dim() > 2:
        lead = a.shape[:-1]
        return _mm_op(a.reshape(-1, a.shape[-1]), b).reshape(*lead, b.shape[-1])
    if b.dim() != 2 and a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"npu matmul: leading dims of {tuple(a.shape)} and {tuple(b.shape)} must match")
    return _mm_op(a, b)


def linear(x2d: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, row_multiple: int = 16) -> torch.Tensor:
    return matmul(x2d, weight.t()).to(out_dtype)


def grad_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Gradient GEMMs through the batch-invariant op too (fp32 in, cast back to the inputs' dtype)."""
    return _mm_op(a.float(), b.float()).to(torch.promote_types(a.dtype, b.dtype))


class _RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keepdim):
        ctx.shape, ctx.keepdim = x.shape, keepdim
        return npu_runtime.load().reduce_sum(x.contiguous(), x.dim() - 1, keepdim)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.keepdim:
            grad = grad.unsqueeze(-1)
        return grad.expand(ctx.shape), None


def row_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Sum over the last dim through the batch-invariant reduce."""
    return _RowSum.apply(x, keepdim)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    return row_sum(x, keepdim=True) / x.shape[-1]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax as exp of the batch-invariant log-softmax (routing only: no autograd)."""
    return torch.exp(npu_runtime.load().log_softmax(x.contiguous(), x.dim() - 1))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    q_positions: Optional[torch.Tensor] = None,
    excluded: Optional[torch.Tensor] = None,
    block_size: int = 128,
    row_multiple: int = 16,
    split_size: Optional[int] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Training / prefill attention through ``flash_attn_npu.flash_attn_func``.

    q (b, hq, sq, d), k/v (b, hkv, sk, d) -> (b, hq, sq, d). The kernel's causal mask is
    bottom-right aligned, i.e. queries are the last sq key positions. ``block_size`` and
    ``row_multiple`` do not apply (the kernel's own fixed tiling).
    """
    if window is not None:  # sliding-window attention: the torch backend only
        raise refuse("attention_window_backend", backend="npu")
    if sinks is not None:  # attention sinks: the torch backend only
        raise refuse("attention_sinks_backend", backend="npu")
    if v.shape[-1] != q.shape[-1]:  # multi-latent attention's values: the torch backend only
        raise refuse("attention_value_head_backend", dv=v.shape[-1], d=q.shape[-1], backend="npu")
    if excluded is not None:
        raise refuse("npu_explicit_mask")
    if split_size is not None:
        raise refuse("npu_split_kv")
    sq, sk = q.shape[2], k.shape[2]
    if q_positions is not None and not torch.equal(q_positions.cpu(), torch.arange(sk - sq, sk)):
        raise refuse("npu_query_alignment")
    out = npu_runtime.load().flash_attn_func(
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
    block_size: int = 128,
    row_multiple: int = 16,
    split_size: Optional[int] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode over a paged KV cache through the v3 ``flash_attn_with_kvcache`` (num_splits=1); see
    ``kernels.attention.decode_attention`` for the shapes."""
    if window is not None:  # sliding-window attention: the torch backend only
        raise refuse("attention_window_backend", backend="npu")
    if sinks is not None:  # attention sinks: the torch backend only
        raise refuse("attention_sinks_backend", backend="npu")
    if v_cache.shape[-1] != q.shape[-1]:  # multi-latent attention's values: the torch backend only
        raise refuse("attention_value_head_backend", dv=v_cache.shape[-1], d=q.shape[-1], backend="npu")
    if split_size is not None:
        raise refuse("npu_split_kv")
    out = npu_runtime.load().flash_attn_with_kvcache(
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
