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
  procedure and agree bit for bit; see ``triton_kernels.attention_kernel``. A mask never reaches
  the kernel: megatron's causal mask is its causal flag, key padding per-sequence key lengths
  (``_mask_as_lengths``); any other mask is refused. Its backward is three kernels of its own
  (``_attention_backward``) from the saved output and log-sum-exp; head dims outside
  ``triton_kernels.ATTN_HEAD_DIMS`` are refused by name.

Every launch compiles to one variant per numerics (``triton_kernels``' docstring): the wrappers
hand the kernels 16-byte aligned, unit-inner-stride tensors (``_aligned``, a copy otherwise) and
their strides in 16-byte units (``_units``), the kernels specialise on no integer argument, FP
contraction is pinned.

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

from ...contract.refusals import refuse
from ...errors import ConfigError

# Explicit attention masks are taken by this backend's attention: causal and key-padding masks,
# recognised and run without a mask (``_mask_as_lengths``); any other is refused.
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


# (setter, the value before it was pinned) of every setting pin_torch_settings changed, first value
# kept across repeated enables: disable() puts them back (``restore_torch_settings``).
_PINNED: List[tuple] = []


def pin_torch_settings() -> List[str]:
    """Pin TF32 off, cuBLAS reduced-precision reductions off, cuDNN deterministic without
    benchmarking. A setting someone changed from torch's default to a conflicting value is named in
    a warning; a conflicting torch default (cuDNN's TF32, the reduced-precision reductions) is pinned
    silently. Returns the names of the settings changed; ``restore_torch_settings`` undoes them."""
    changed = []
    for name, get, set_, wanted, default in _settings():
        current = get()
        if current == wanted:
            continue
        if current != default:
            warnings.warn(f"mindspeed-tp: {name}={current!r} conflicts with the triton backend's fixed-precision "
                          f"kernels (TF32 or a shape-dependent reduction could leak into patched paths); setting "
                          f"{name}={wanted!r}", RuntimeWarning, stacklevel=3)
        _PINNED.append((name, set_, current))
        set_(wanted)
        changed.append(name)
    return changed


def restore_torch_settings() -> List[str]:
    """What disable() runs: every setting ``pin_torch_settings`` changed back to the value it had
    (the process-wide flags are the user's again once the patches are off); returns their names."""
    restored = []
    while _PINNED:
        name, set_, value = _PINNED.pop()
        set_(value)
        restored.append(name)
    return restored


release = restore_torch_settings  # disable()'s counterpart of ``prepare`` (kernels/dispatch.release)


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


def build_identity() -> dict:
    """What the compiled kernels' bits depend on besides the profile and the GPU: the Triton version
    and the FP contraction pinned at launch (for a report, and for ranks to compare)."""
    import triton

    return {"triton": triton.__version__, "enable_fp_fusion": _kernels().FP_FUSION}


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


def _vec(dtype: torch.dtype) -> int:
    """16 bytes in elements of ``dtype``: what the kernels state of every stride they are given."""
    return _kernels().ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size()


def _is_aligned(t: torch.Tensor) -> bool:
    """Base and every stride 16-byte multiples, the innermost stride 1 (dims of size 1 never move)."""
    size = t.element_size()
    align = _kernels().ALIGN_BYTES
    if t.data_ptr() % align:
        return False
    for n, (extent, stride) in enumerate(zip(t.shape, t.stride())):
        if extent > 1 and (stride != 1 if n == t.dim() - 1 else (stride * size) % align):
            return False
    return True


def _aligned(t: torch.Tensor, inner: Optional[int] = None) -> torch.Tensor:
    """``t`` itself when the kernels' alignment statement holds for it, else a copy whose last dim is
    stored padded (with zeros) to ``inner`` elements or the next 16-byte multiple; the view keeps
    ``t``'s shape. A copy, never a differently compiled kernel."""
    last = t.shape[-1] if t.dim() else 1
    vec = _vec(t.dtype)
    width = inner if inner is not None else -(-last // vec) * vec
    if width == last and _is_aligned(t):
        return t
    store = torch.zeros(*t.shape[:-1], width, dtype=t.dtype, device=t.device)
    store[..., :last] = t
    return store[..., :last]


def _units(t: torch.Tensor, *dims: int) -> List[int]:
    """Strides of an ``_aligned`` tensor in 16-byte units: what the kernels take, so that they know
    the alignment by construction (a stride is ``units * VEC`` there) instead of by specialisation."""
    return [t.stride(d) // _vec(t.dtype) for d in dims]


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """(L, M, K) @ (L, K, N) (+ bias (N,)) -> (L, M, N) in out_dtype; one launch for the batch."""
    kernels = _kernels()
    a, b = _same_compute_dtype(a, b)
    _check_device(a, b)
    batch, m, k = a.shape
    n = b.shape[-1]
    out = _aligned(torch.empty(batch, m, n, dtype=_store_dtype(out_dtype), device=a.device))
    if m == 0 or n == 0 or batch == 0:
        return out.to(out_dtype)
    half = a.dtype != torch.float32
    bm, bn, bk, group, warps, stages = kernels.GEMM_TILES_HALF if half else kernels.GEMM_TILES_FP32
    vec = _vec(a.dtype)
    k_pad = -(-k // vec) * vec  # zeros past K: what the kernel's masked tail reads anyway
    a = _aligned(a, k_pad)
    bt = _aligned(b.transpose(1, 2), k_pad)  # (L, N, K): the weight's own layout
    grid = (_cdiv(m, bm) * _cdiv(n, bn), batch)
    kernels.gemm_kernel[grid](
        a, bt, bias if bias is not None else out, out,
        m, n, k_pad // vec, *_units(a, 0, 1), *_units(bt, 0, 1), *_units(out, 0, 1),
        HAS_BIAS=bias is not None, INTERPRETED=kernels.INTERPRETED,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, VEC=vec, C_VEC=_vec(out.dtype), num_warps=warps,
        num_stages=stages, **kernels.LAUNCH,
    )
    return out.to(out_dtype) if out.is_contiguous() else out.to(out_dtype).contiguous()


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
    return _aligned(x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1))


def _row_sum_forward(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    kernels = _kernels()
    _check_device(x)
    x2d = _rows(x)
    out = torch.empty(x2d.shape[0], dtype=torch.float32, device=x.device)
    if x2d.shape[0]:
        kernels.row_sum_kernel[(x2d.shape[0],)](x2d, out, x2d.shape[1], *_units(x2d, 0),
                                                BLOCK=kernels.ROW_BLOCK, VEC=_vec(x2d.dtype),
                                                num_warps=kernels.ROW_WARPS, **kernels.LAUNCH)
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
        kernels.softmax_kernel[(x2d.shape[0],)](x2d, out, x2d.shape[1], *_units(x2d, 0), out.stride(0),
                                                BLOCK=kernels.ROW_BLOCK, VEC=_vec(x2d.dtype),
                                                num_warps=kernels.ROW_WARPS, **kernels.LAUNCH)
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


def _generation(device: torch.device) -> int:
    """9 on sm_90 and later GPUs, 8 before (and under the interpreter 9): the attention tiles'
    key (``triton_kernels.ATTN_TILES``)."""
    if _kernels().INTERPRETED or device.type != "cuda":
        return 9
    return 9 if torch.cuda.get_device_capability(device)[0] >= 9 else 8


def _mask_as_lengths(excluded: torch.Tensor, positions: torch.Tensor, sk: int, causal: bool):
    """An explicit mask as the kernel runs it: (causal, keys per batch entry). ``excluded`` (bool,
    broadcastable to (b, 1, sq, width), True hides; keys past ``width`` hidden) must hide exactly
    what the causal flag (given or recognised: megatron's causal mask) and per-entry key padding
    (keys from the entry's length on, hidden from every query) hide; anything else is refused, so the
    kernel never reads a dense mask. One comparison on the device, one host sync."""
    b, sq = positions.shape
    ex = torch.broadcast_to(excluded.to(device=positions.device, dtype=torch.bool),
                            (b, 1, sq, excluded.shape[-1]))[:, 0]
    if ex.shape[-1] < sk:
        ex = torch.cat([ex, ex.new_ones(b, sq, sk - ex.shape[-1])], dim=-1)
    ex = ex[..., :sk]
    keys = torch.arange(sk, device=positions.device)
    hidden_from_all = ex.all(dim=1)  # (b, sk)
    lengths = sk - hidden_from_all.flip(-1).to(torch.int32).cumprod(-1).sum(-1)
    padding = (keys.view(1, sk) >= lengths.view(b, 1)).unsqueeze(1)  # (b, 1, sk)
    future = keys.view(1, 1, sk) > positions.view(b, sq, 1)  # (b, sq, sk)
    as_padding = torch.equal(ex | future, padding | future) if causal else torch.equal(ex, padding.expand_as(ex))
    if not as_padding and not causal and torch.equal(ex, padding | future):
        causal, as_padding = True, True
    if not as_padding:
        raise refuse("triton_dense_mask", shape=tuple(excluded.shape))
    return causal, lengths.to(torch.int32)


def _check_head_dim(d: int) -> None:
    if d not in _kernels().ATTN_HEAD_DIMS:
        raise refuse("attention_head_dim_backend", d=d, dims=", ".join(map(str, _kernels().ATTN_HEAD_DIMS)))


def _attention_launch(q, k_pages, v_pages, page_dims, positions, seqlens, table, scale, causal, block_size,
                      split_size):
    """q (b, hq, sq, d); k/v reachable as pages: ``page_dims`` names (page, offset, head, dim) of
    k_pages/v_pages (dim last); positions (b, sq); seqlens (b,) keys per entry; table (b, pages).
    Returns the output (b, hq, sq, d) in q's dtype and each query's log-sum-exp (b, hq, sq) in fp32."""
    b, hq, sq, d = q.shape
    if v_pages.shape[page_dims[3]] != d:  # multi-latent attention's values: the torch backend only
        raise refuse("attention_value_head_backend", dv=v_pages.shape[page_dims[3]], d=d, backend="triton")
    _check_head_dim(d)
    kernels = _kernels()
    hkv = k_pages.shape[page_dims[2]]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not divisible by key/value heads {hkv}")
    if split_size is not None and (split_size < block_size or split_size % block_size):
        raise ValueError(f"split_size={split_size} must be a positive multiple of block_size={block_size}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        k_pages, v_pages = k_pages.to(q.dtype), v_pages.to(q.dtype)
    _check_device(q, k_pages, v_pages)
    out = torch.empty(b, hq, sq, d, dtype=_store_dtype(q.dtype), device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out.to(q.dtype), lse
    q, k_pages, v_pages = _aligned(q), _aligned(k_pages), _aligned(v_pages)
    o = _aligned(out)
    positions = positions if positions.stride(1) == 1 or sq == 1 else positions.contiguous()
    table = table if table.stride(1) == 1 or table.shape[1] == 1 else table.contiguous()
    page_size = k_pages.shape[page_dims[1]]
    block_q, warps, stages = kernels.tiles_for(kernels.ATTN_TILES, _tiles(q), d)
    grid = (_cdiv(sq, block_q), b * hq)
    kernels.attention_kernel[grid](
        q, k_pages, v_pages, o, lse, positions, seqlens, table,
        sq, hq, hq // hkv, float(scale), block_size, split_size // block_size if split_size else 1, page_size,
        int(bool(causal)),
        *_units(q, 0, 1, 2), *_units(k_pages, *page_dims[:3]), *_units(v_pages, *page_dims[:3]), *_units(o, 0, 1, 2),
        positions.stride(0), table.stride(0),
        D=d, SPLIT=split_size is not None, INTERPRETED=kernels.INTERPRETED,
        BLOCK_Q=block_q, BLOCK_KEYS=max(16, _next_power_of_2(block_size)),
        BLOCK_D=_block_d(d), VEC=_vec(q.dtype), O_VEC=_vec(o.dtype), num_warps=warps,
        num_stages=stages, **kernels.LAUNCH,
    )
    out = o if o is out else o.contiguous()
    return out.to(q.dtype), lse


def _tiles(q: torch.Tensor):
    """The tile tables' key: ("fp32" | "half", GPU generation)."""
    return "fp32" if q.dtype == torch.float32 else "half", _generation(q.device)


def _block_d(d: int) -> int:
    return max(16, _next_power_of_2(d))


def _attention_backward(q, k, v, out, lse, grad, positions, seqlens, scale, causal):
    """dQ, dK, dV (fp32) of the training layout's attention (q, out, grad (b, hq, sq, d); k, v
    (b, hkv, sk, d); positions (b, sq); seqlens (b,)) from the forward's output and log-sum-exp: three
    launches (``triton_kernels``: delta, dK / dV per key block, dQ per query block)."""
    kernels = _kernels()
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    grad = grad.to(q.dtype)
    k, v = k.to(q.dtype), v.to(q.dtype)
    _check_device(q, k, v, out, grad)
    q, k, v, out, grad = (_aligned(t) for t in (q, k, v, out, grad))
    positions = positions if positions.stride(1) == 1 or sq == 1 else positions.contiguous()
    dq = torch.zeros(b, hq, sq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, hkv, sk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    if q.numel() == 0 or k.numel() == 0:
        return dq, dk, dv
    vec = _vec(q.dtype)
    tiles = kernels.tiles_for(kernels.ATTN_BWD_TILES, _tiles(q), d)
    delta = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    block_q = tiles["dq"][0]
    kernels.attention_delta_kernel[(_cdiv(sq, block_q), b * hq)](
        out, grad, delta, sq, hq, *_units(out, 0, 1, 2), *_units(grad, 0, 1, 2), D=d, BLOCK_Q=block_q,
        BLOCK_D=_block_d(d), VEC=vec, num_warps=4, **kernels.LAUNCH)
    strides = (*_units(q, 0, 1, 2), *_units(k, 0, 1, 2), *_units(v, 0, 1, 2), *_units(grad, 0, 1, 2),
               positions.stride(0))
    flags = (hq // hkv, float(scale), int(bool(causal)))

    def meta(block_q, block_keys, warps, stages):
        return dict(D=d, INTERPRETED=kernels.INTERPRETED, BLOCK_Q=block_q, BLOCK_KEYS=block_keys,
                    BLOCK_D=_block_d(d), VEC=vec, num_warps=warps, num_stages=stages, **kernels.LAUNCH)

    block_keys = tiles["dkdv"][1]
    kernels.attention_dkdv_kernel[(_cdiv(sk, block_keys), b * hkv)](
        q, k, v, grad, lse, delta, positions, seqlens, dk, dv, sq, sk, hq, *flags, *strides, **meta(*tiles["dkdv"]))
    kernels.attention_dq_kernel[(_cdiv(sq, block_q), b * hq)](
        q, k, v, grad, lse, delta, positions, seqlens, dq, sq, hq, *flags, *strides, **meta(*tiles["dq"]))
    return dq, dk, dv


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
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Consistent attention for q (b, hq, sq, d) over k, v (b, hkv, sk, d) -> (b, hq, sq, d).

    q_positions: each query's absolute position (default the last sq key positions), shared by the
    batch; excluded: bool broadcastable to (b, 1, sq, sk), True hides a key (keys past its last
    column are hidden): a causal and/or key-padding mask, run as the causal flag and key lengths
    (``_mask_as_lengths``), any other refused; split_size: a multiple of block_size, or None. ``row_multiple`` is unused
    (fixed tiles). Each sequence is one page of the kernel's paged addressing. Backward: the backward
    kernels (``_attention_backward``), exact attention's gradient from the saved output and log-sum-exp.
    """
    if window is not None:  # sliding-window attention: the torch backend only
        raise refuse("attention_window_backend", backend="triton")
    if sinks is not None:  # attention sinks: the torch backend only
        raise refuse("attention_sinks_backend", backend="triton")
    args = (scale, causal, q_positions, excluded, block_size, split_size)
    if _needs_grad(q, k, v):
        return _Attention.apply(q, k, v, args)
    return _attention_forward(q, k, v, *args)[0]


class _Attention(torch.autograd.Function):
    """The kernel's forward; the backward kernels from the saved output and log-sum-exp (the mask
    already as the causal flag and key lengths)."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        out, lse, positions, seqlens, causal = _attention_forward(q, k, v, *args)
        ctx.save_for_backward(q, k, v, out, lse, positions, seqlens)
        ctx.scale, ctx.causal = args[0], causal
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, positions, seqlens = ctx.saved_tensors
        dq, dk, dv = _attention_backward(q, k, v, out, lse, grad, positions, seqlens, ctx.scale, ctx.causal)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _attention_forward(q, k, v, scale, causal, q_positions, excluded, block_size, split_size):
    """(output, log-sum-exp, positions (b, sq), keys per entry (b,), causal flag) of training's layout."""
    b, _, sq, _ = q.shape
    sk = k.shape[2]
    device = q.device
    if q_positions is None:
        q_positions = torch.arange(sk - sq, sk, device=device)
    if q_positions.shape != (sq,):
        raise ValueError(f"q_positions must have shape ({sq},), got {tuple(q_positions.shape)}")
    positions = q_positions.to(device=device, dtype=torch.int32).reshape(1, sq).expand(b, sq)
    if excluded is None:
        seqlens = torch.full((b,), sk, dtype=torch.int32, device=device)
    else:
        causal, seqlens = _mask_as_lengths(excluded, positions, sk, causal)
    table = torch.arange(b, dtype=torch.int32, device=device).reshape(b, 1)
    # k (b, hkv, sk, d) read as pages (page=b, offset=key, head, dim) of sk keys.
    out, lse = _attention_launch(q, k, v, (0, 2, 1, 3), positions, seqlens, table, scale, causal, block_size,
                                 split_size)
    return out, lse, positions, seqlens, causal


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
    """Causal attention of each request's last sq tokens over a paged KV cache (the rollout step).

    q (b, hq, sq, d); k_cache/v_cache (num_pages, page_size, hkv, d); page_table (b, pages) page ids
    in order; cache_seqlens (b,) keys per request, the new tokens included. The same kernel as
    ``attention``, so a decode step equals the training forward bitwise.
    """
    if window is not None:  # sliding-window attention: the torch backend only
        raise refuse("attention_window_backend", backend="triton")
    if sinks is not None:  # attention sinks: the torch backend only
        raise refuse("attention_sinks_backend", backend="triton")
    b, _, sq, _ = q.shape
    device = q.device
    seqlens = cache_seqlens.to(device=device, dtype=torch.int32)
    positions = seqlens.reshape(b, 1) - sq + torch.arange(sq, dtype=torch.int32, device=device).reshape(1, sq)
    table = page_table.to(device=device, dtype=torch.int32)
    return _attention_launch(q, k_cache, v_cache, (0, 1, 2, 3), positions, seqlens, table, scale, True,
                             block_size, split_size)[0]

