"""The triton kernel backend: the primitive kernels as Triton kernels, for CUDA tensors.

Same semantics as the torch reference primitives, with the invariance the contract needs made a
property of the kernels instead of BLAS luck:

- ``matmul`` / ``linear``: fp32 accumulation in one fixed tile configuration (chosen by the input
  dtype, never by a shape), no split-K, K visited in order, so an output row depends only on that
  row and the weights (M-invariant) and a column only on that column (N-shard invariant). A batch
  of canonical-tree leaves (L, M, K/C) x (L, K/C, N) is one launch.
- ``row_sum`` / ``softmax``: one program per row, fixed chunking and one fixed tree sum per row.
- ``attention`` / ``decode_attention``: one kernel for training, chunked prefill and paged-KV
  decode (training passes each sequence as one page), so the three modes run the same per-query
  procedure and agree bit for bit; see ``triton_kernels.attention_kernel``.

``row_multiple`` (the CPU BLAS row padding) does not apply here: the tiles are fixed. The bits
differ from the CPU reference's (other hardware, other summation inside a tile); they do not
differ between layouts or modes on one GPU. ``prepare`` is what enable() runs for this backend.

Tested on CPU under Triton's interpreter (tests/test_triton_backend.py); only a GPU run shows
the compiled kernels keep the same invariance (scripts/device_check.sh).
"""
import importlib
import os
import warnings
from typing import List, Optional

import torch

from ...errors import ConfigError
from . import torch as torch_backend

# Explicit (padding) attention masks are honoured by this backend's attention.
EXPLICIT_MASKS = True

_INSTALL = ("install it (pip install triton; CUDA builds of torch ship a matching one), or set the profile's "
            "backend: torch")


def _kernels():
    """The @triton.jit kernels; imported on first use so this module imports without triton."""
    from . import triton_kernels

    return triton_kernels


def available() -> bool:
    """Whether this backend can run here: triton imports and there is a CUDA device, or Triton's
    interpreter is on (TRITON_INTERPRET=1: CPU tensors, for tests)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


# Global torch settings a patched path could pick up (backward GEMMs, the torch ops around the
# kernels, anything still on cuBLAS/cuDNN): (name, getter, setter, wanted value, torch's default).
def _settings():
    cuda_mm = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn

    def attr(obj, name):
        return (lambda: getattr(obj, name)), (lambda value: setattr(obj, name, value))

    rows = [
        ("torch.backends.cuda.matmul.allow_tf32", *attr(cuda_mm, "allow_tf32"), False, False),
        ("torch.float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision,
         "highest", "highest"),
        ("torch.backends.cudnn.allow_tf32", *attr(cudnn, "allow_tf32"), False, True),
        ("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
         *attr(cuda_mm, "allow_bf16_reduced_precision_reduction"), False, True),
        ("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
         *attr(cuda_mm, "allow_fp16_reduced_precision_reduction"), False, True),
        ("torch.backends.cudnn.benchmark", *attr(cudnn, "benchmark"), False, False),
        ("torch.backends.cudnn.deterministic", *attr(cudnn, "deterministic"), True, False),
    ]
    try:
        getattr(cuda_mm, "allow_fp16_accumulation")
        rows.append(("torch.backends.cuda.matmul.allow_fp16_accumulation",
                     *attr(cuda_mm, "allow_fp16_accumulation"), False, False))
    except AttributeError:  # older torch
        pass
    return rows


def pin_torch_settings() -> List[str]:
    """Pin TF32 off, cuBLAS reduced-precision reductions off, cuDNN deterministic without
    benchmarking. A setting someone changed from torch's default to a conflicting value is named in
    a warning; a conflicting torch default (cuDNN's TF32, the reduced-precision reductions) is pinned
    silently. Returns the names of the settings changed."""
    changed = []
    for name, get, set_, wanted, default in _settings():
        current = get()
        if current == wanted:
            continue
        if current != default:
            warnings.warn(f"mindspeed-tp: {name}={current!r} conflicts with the triton backend's fixed-precision "
                          f"kernels (TF32 or a shape-dependent reduction could leak into patched paths); setting "
                          f"{name}={wanted!r}", RuntimeWarning, stacklevel=3)
        set_(wanted)
        changed.append(name)
    return changed


def prepare(profile=None) -> List[str]:
    """What enable() runs for the triton backend: triton must import (a ConfigError names the
    package otherwise: enabling on CUDA without Triton must not fall back to cuBLAS), then the torch
    settings are pinned. ``profile`` is accepted for the dispatcher's uniform call; no profile field
    changes what is prepared. Returns the settings changed."""
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        raise ConfigError(f"the triton kernel backend (CUDA tensors with backend: auto or triton) needs the package "
                          f"'triton', which cannot be imported ({exc}): {_INSTALL}") from exc
    return pin_torch_settings()


def _check_device(*tensors: torch.Tensor) -> None:
    interpreted = _kernels().INTERPRETED
    for t in tensors:
        if t.device.type != "cuda" and not (interpreted and t.device.type == "cpu"):
            raise ValueError(f"the triton backend runs CUDA tensors (CPU tensors only under TRITON_INTERPRET=1), got "
                             f"a tensor on {t.device}")


def _same_compute_dtype(a: torch.Tensor, b: torch.Tensor):
    """bf16/fp16 pairs stay in their dtype (exact products, fp32 accumulation); anything else fp32."""
    if a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return a, b
    return a.float(), b.float()


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """(L, M, K) @ (L, K, N) (+ bias (N,)) -> (L, M, N) in out_dtype; one launch for the batch."""
    kernels = _kernels()
    a, b = _same_compute_dtype(a, b)
    _check_device(a, b)
    batch, m, k = a.shape
    n = b.shape[-1]
    out = torch.empty(batch, m, n, dtype=_store_dtype(out_dtype), device=a.device)
    if m == 0 or n == 0 or batch == 0:
        return out.to(out_dtype)
    half = a.dtype != torch.float32
    bm, bn, bk, group, warps, stages = kernels.GEMM_TILES_HALF if half else kernels.GEMM_TILES_FP32
    grid = (_cdiv(m, bm) * _cdiv(n, bn), batch)
    kernels.gemm_kernel[grid](
        a, b, bias if bias is not None else out, out,
        m, n, k,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HAS_BIAS=bias is not None, INTERPRETED=kernels.INTERPRETED,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages,
    )
    return out.to(out_dtype)


def _store_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """What a kernel writes: out_dtype (the cast happens in the kernel), except under the interpreter,
    whose fp32 -> bf16/fp16 conversion does not round to nearest even: there the kernel writes fp32
    and torch casts (the same rounding the compiled kernel's cast does)."""
    return torch.float32 if _kernels().INTERPRETED else out_dtype


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _matmul_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    if b.dim() == 2:  # a's leading dims are rows of one GEMM: row-invariance makes that exact
        rows = a.reshape(1, -1, a.shape[-1])
        return _gemm(rows, b.unsqueeze(0), None, torch.float32).reshape(*a.shape[:-1], b.shape[-1])
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return _gemm(a3, b3, None, torch.float32).reshape(*lead, a.shape[-2], b.shape[-1])


class _Matmul(torch.autograd.Function):
    """The invariant forward; a plain fp32 backward (only the forward carries the contract)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _matmul_forward(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.matmul(grad, b.float().transpose(-1, -2))
            grad_a = grad_a.sum_to_size(a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = torch.matmul(a.float().transpose(-1, -2), grad)
            grad_b = grad_b.sum_to_size(b.shape).to(b.dtype)
        return grad_a, grad_b


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def matmul(a: torch.Tensor, b: torch.Tensor, row_multiple: int = 16) -> torch.Tensor:
    """fp32 ``a @ b`` for a (..., M, K) and b (K, N) or (..., K, N); row-invariant in M,
    shard-invariant in N. A 3-D a and b (the leaves of a rank's subtree) are one launch.
    ``row_multiple`` does not apply (fixed tiles)."""
    if _needs_grad(a, b):
        return _Matmul.apply(a, b)
    return _matmul_forward(a, b)


def _linear_forward(x2d, weight, bias, out_dtype):
    if x2d.dim() != 2 or weight.dim() != 2 or x2d.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x2d.shape)} and weight {tuple(weight.shape)} must be (M, K) and (N, K)")
    if bias is not None:
        _check_device(bias)
    return _gemm(x2d.unsqueeze(0), weight.t().unsqueeze(0), bias, out_dtype)[0]


def linear(x2d: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, row_multiple: int = 16,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x2d @ weight.T (+ bias)`` accumulated in fp32, the bias added in fp32, one cast to
    ``out_dtype``, all inside the kernel (forward only: the composite supplies the backward).
    ``row_multiple`` does not apply (fixed tiles)."""
    return _linear_forward(x2d, weight, bias, out_dtype)


def grad_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A gradient GEMM in the inputs' dtype, as an unpatched linear's (backward is outside the
    bitwise contract; cuBLAS with TF32 off, see ``prepare``)."""
    return a @ b


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def _row_sum_forward(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    kernels = _kernels()
    _check_device(x)
    x2d = _rows(x)
    out = torch.empty(x2d.shape[0], dtype=torch.float32, device=x.device)
    if x2d.shape[0]:
        kernels.row_sum_kernel[(x2d.shape[0],)](x2d, out, x2d.shape[1], x2d.stride(0), BLOCK=kernels.ROW_BLOCK,
                                                num_warps=kernels.ROW_WARPS)
    out = out.reshape(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


class _RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keepdim):
        ctx.shape, ctx.dtype, ctx.keepdim = x.shape, x.dtype, keepdim
        return _row_sum_forward(x, keepdim)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.keepdim:
            grad = grad.unsqueeze(-1)
        return grad.expand(ctx.shape).to(ctx.dtype), None


def row_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """fp32 sum over the last dim, in a fixed order per row (independent of the other rows)."""
    if _needs_grad(x):
        return _RowSum.apply(x, keepdim)
    return _row_sum_forward(x, keepdim)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim, keepdim: the fixed-order row sum over the length."""
    return row_sum(x, keepdim=True) / x.shape[-1]


def _softmax_forward(x: torch.Tensor) -> torch.Tensor:
    kernels = _kernels()
    _check_device(x)
    x2d = _rows(x)
    out = torch.empty(x2d.shape, dtype=torch.float32, device=x.device)
    if x2d.shape[0]:
        kernels.softmax_kernel[(x2d.shape[0],)](x2d, out, x2d.shape[1], x2d.stride(0), out.stride(0),
                                                BLOCK=kernels.ROW_BLOCK, num_warps=kernels.ROW_WARPS)
    return out.reshape(x.shape)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = _softmax_forward(x)
        ctx.save_for_backward(y)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        g = grad.float()
        return (y * (g - (g * y).sum(-1, keepdim=True))).to(ctx.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim (the router), row by row."""
    if _needs_grad(x):
        return _Softmax.apply(x)
    return _softmax_forward(x)


def _attention_launch(q, k_pages, v_pages, page_dims, positions, seqlens, table, excluded, scale, causal,
                      block_size, split_size):
    """q (b, hq, sq, d); k/v reachable as pages: ``page_dims`` names (page, offset, head, dim) of
    k_pages/v_pages; positions (b, sq); seqlens (b,) keys per entry; table (b, pages)."""
    kernels = _kernels()
    b, hq, sq, d = q.shape
    hkv = k_pages.shape[page_dims[2]]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not divisible by key/value heads {hkv}")
    if split_size is not None and (split_size < block_size or split_size % block_size):
        raise ValueError(f"split_size={split_size} must be a positive multiple of block_size={block_size}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        k_pages, v_pages = k_pages.to(q.dtype), v_pages.to(q.dtype)
    _check_device(q, k_pages, v_pages)
    out = torch.empty(b, hq, sq, d, dtype=_store_dtype(q.dtype), device=q.device)
    if out.numel() == 0:
        return out.to(q.dtype)
    page_size = k_pages.shape[page_dims[1]]
    if excluded is None:  # nothing hidden: one byte read for every key, always 0
        ex, ex_strides, ex_width = torch.zeros(1, dtype=torch.uint8, device=q.device), (0, 0, 0), 2 ** 30
    else:
        ex = torch.broadcast_to(excluded.to(torch.bool).view(torch.uint8), (b, 1, sq, excluded.shape[-1]))
        ex_strides, ex_width = (ex.stride(0), ex.stride(2), ex.stride(3)), excluded.shape[-1]
    ks = [k_pages.stride(i) for i in page_dims]
    vs = [v_pages.stride(i) for i in page_dims]
    block_q = kernels.ATTN_BLOCK_Q
    grid = (_cdiv(sq, block_q), b * hq)
    kernels.attention_kernel[grid](
        q, k_pages, v_pages, out, positions, seqlens, table, ex,
        sq, hq, hq // hkv, float(scale), block_size, split_size // block_size if split_size else 1, page_size,
        ex_width,
        *q.stride(), *ks, *vs, *out.stride(),
        positions.stride(0), positions.stride(1), table.stride(0), table.stride(1), *ex_strides,
        D=d, CAUSAL=bool(causal), SPLIT=split_size is not None, INTERPRETED=kernels.INTERPRETED,
        BLOCK_Q=block_q, BLOCK_KEYS=max(16, _next_power_of_2(block_size)),
        BLOCK_D=max(16, _next_power_of_2(d)), num_warps=kernels.ATTN_WARPS, num_stages=kernels.ATTN_STAGES,
    )
    return out.to(q.dtype)


def attention(
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
) -> torch.Tensor:
    """Consistent attention for q (b, hq, sq, d) over k, v (b, hkv, sk, d) -> (b, hq, sq, d).

    q_positions: each query's absolute position (default the last sq key positions), shared by the
    batch; excluded: bool broadcastable to (b, 1, sq, sk), True hides a key (keys past its last
    column are hidden); split_size: a multiple of block_size, or None. ``row_multiple`` is unused
    (fixed tiles). Each sequence is one page of the kernel's paged addressing. Backward: the torch
    reference's (exact attention's gradient recomputed tile by tile from q, k, v).
    """
    args = (scale, causal, q_positions, excluded, block_size, row_multiple, split_size)
    if _needs_grad(q, k, v):
        return _TritonRecompute.apply(q, k, v, args)
    return _attention_forward(q, k, v, *args)


class _TritonRecompute(torch_backend._RecomputeBackward):
    """This backend's forward with the torch reference's recomputing backward."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        ctx.save_for_backward(q, k, v)
        ctx.args = args
        return _attention_forward(q, k, v, *args)


def _attention_forward(q, k, v, scale, causal, q_positions, excluded, block_size, row_multiple, split_size):
    b, _, sq, _ = q.shape
    sk = k.shape[2]
    device = q.device
    if q_positions is None:
        q_positions = torch.arange(sk - sq, sk, device=device)
    if q_positions.shape != (sq,):
        raise ValueError(f"q_positions must have shape ({sq},), got {tuple(q_positions.shape)}")
    positions = q_positions.to(device=device, dtype=torch.int32).reshape(1, sq).expand(b, sq)
    seqlens = torch.full((b,), sk, dtype=torch.int32, device=device)
    table = torch.arange(b, dtype=torch.int32, device=device).reshape(b, 1)
    # k (b, hkv, sk, d) read as pages (page=b, offset=key, head, dim) of sk keys.
    return _attention_launch(q, k, v, (0, 2, 1, 3), positions, seqlens, table, excluded, scale, causal,
                             block_size, split_size)


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
) -> torch.Tensor:
    """Causal attention of each request's last sq tokens over a paged KV cache (the rollout step).

    q (b, hq, sq, d); k_cache/v_cache (num_pages, page_size, hkv, d); page_table (b, pages) page ids
    in order; cache_seqlens (b,) keys per request, the new tokens included. The same kernel as
    ``attention``, so a decode step equals the training forward bitwise.
    """
    b, _, sq, _ = q.shape
    device = q.device
    seqlens = cache_seqlens.to(device=device, dtype=torch.int32)
    positions = seqlens.reshape(b, 1) - sq + torch.arange(sq, dtype=torch.int32, device=device).reshape(1, sq)
    table = page_table.to(device=device, dtype=torch.int32)
    return _attention_launch(q, k_cache, v_cache, (0, 1, 2, 3), positions, seqlens, table, None, scale, True,
                             block_size, split_size)

