"""The torch reference backend: every primitive kernel in plain torch (CPU, always tested).

These define the primitives' semantics; other backends (``npu.py``) implement the same names.
- GEMMs: a row of the output depends only on that row of the input and on the weights, never on how
  many rows were computed together nor on which column shard a rank holds. CPU BLAS libraries pick
  their kernel, and with it the K order, from the call's shape (MKL and oneDNN switch paths for small
  or odd M, for column tails and per ISA: AVX2, AVX-512, AMX), so the shape a linear layer's weight
  reaches the library with is fixed by construction: rows padded to a multiple of ``row_multiple``,
  output columns in tiles of ``COLUMN_TILE`` (the last one zero-padded), one call per tile. A column
  shard a rank holds is then a run of the same calls the full weight makes (tested over K, N, M,
  threads and dtypes in tests/test_gemm_invariance.py, which names the CPU it ran on). CPU only:
  dispatch refuses CUDA tensors.
- Attention: per query and head, fp32 scores, keys visited in fixed blocks of ``block_size``
  aligned to absolute key positions, online softmax in fp32, invisible keys excluded by select
  (never a large negative additive mask), one final division and one cast. A fully invisible block
  contributes exactly nothing (rescale factor exp(0) = 1, zero probabilities), so a caller that
  stops early at the last visible block -- a decode step -- gets the same bits as training.
"""
from typing import Optional

import torch

from ..elementwise import exp

# Explicit (padding) attention masks are honoured by this backend's attention.
EXPLICIT_MASKS = True


def _pad_rows(x2d: torch.Tensor, multiple: int) -> torch.Tensor:
    rows = x2d.shape[-2]
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return x2d
    if x2d.dim() == 2 and x2d.stride(0) == 1 and x2d.shape[1] > 1:
        # A transposed (column-major) matrix stays column-major: the layout the library sees is the
        # caller's (a weight gradient's dy^T), whether or not its row count needed padding.
        return torch.cat([x2d.t(), x2d.new_zeros(x2d.shape[1], padded - rows)], dim=1).t()
    pad = x2d.new_zeros(*x2d.shape[:-2], padded - rows, x2d.shape[-1])
    return torch.cat([x2d, pad], dim=-2)


def matmul(a: torch.Tensor, b: torch.Tensor, row_multiple: int = 16) -> torch.Tensor:
    """fp32 ``a @ b`` for ``a`` (..., M, K) and ``b`` (..., K, N) or (K, N), row-invariant in M."""
    rows = a.shape[-2]
    out = torch.matmul(_pad_rows(a.float(), row_multiple), b.float())
    return out[..., :rows, :]


# The output columns one GEMM call computes (see the module docstring). A multiple of every x86 BLAS
# micro-kernel width; 128 divides the projections of real models and vocabularies padded to 128 * C.
COLUMN_TILE = 128


def linear(x2d: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, row_multiple: int = 16) -> torch.Tensor:
    """``x2d @ weight.T`` accumulated in fp32, cast once to ``out_dtype`` (forward only): one library
    call of shape (rows padded, K, COLUMN_TILE) per tile of output columns."""
    rows, n = x2d.shape[0], weight.shape[0]
    # CPU bf16: oneDNN's bf16 GEMM accumulates in fp32 and rounds once, 2-2.5x faster than an fp32 GEMM
    # of upcast inputs (5x with native AVX-512-BF16 / AMX); row- and shard-invariant at fixed shapes.
    native_bf16 = x2d.dtype == weight.dtype == out_dtype == torch.bfloat16 and x2d.device.type == "cpu"
    # One operand layout per call site, whatever the shard: the library's path (and K order) can
    # follow the operands' strides (torch's own bf16 GEMM on a CPU without AVX-512-BF16 accumulates a
    # transposed operand in another order). ``a`` keeps the caller's layout (row-major x, or a weight
    # gradient's column-major dy^T, padded or not: no copy of dy); every tile is row-major (a weight
    # gradient's x^T tiles are strided views, the zero-padded last tile a copy).
    a = _pad_rows(x2d if native_bf16 else x2d.float(), row_multiple)
    w = weight if native_bf16 else weight.float()
    if n == 0:
        return x2d.new_zeros(rows, 0, dtype=out_dtype)
    # Each tile's product lands in one preallocated output: at a real vocabulary (an LM head of
    # 75968 columns per rank) a list of tiles joined by cat would hold the logits twice.
    out = None
    for start in range(0, n, COLUMN_TILE):
        tile = w[start:start + COLUMN_TILE]
        width = tile.shape[0]
        if width < COLUMN_TILE:
            tile = torch.cat([tile, tile.new_zeros(COLUMN_TILE - width, tile.shape[1])])
        product = torch.matmul(a, tile.contiguous().t())
        if out is None:
            if width == n:
                return product[:rows, :n].to(out_dtype)
            out = product.new_empty((rows, n))
        out[:, start:start + width].copy_(product[:rows, :width])
    return out.to(out_dtype)


def grad_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A gradient GEMM (dx = dy @ w, dw = dy^T @ x) in the inputs' dtype, as an unpatched linear's."""
    return a @ b


def row_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    return x.sum(-1, keepdim=keepdim)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim, keepdim."""
    return x.mean(-1, keepdim=True)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def _pad_keys(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.shape[-2] == length:
        return t
    pad = t.new_zeros(*t.shape[:-2], length - t.shape[-2], t.shape[-1])
    return torch.cat([t, pad], dim=-2)


def _merge(a, b):
    """Merge two online-softmax states (m, l, acc) over disjoint key sets, a before b."""
    (m1, l1, acc1), (m2, l2, acc2) = a, b
    m = torch.maximum(m1, m2)
    m_safe = torch.where(m == float("-inf"), 0.0, m)
    s1, s2 = exp(m1 - m_safe), exp(m2 - m_safe)
    return m, l1 * s1 + l2 * s2, acc1 * s1.unsqueeze(-1) + acc2 * s2.unsqueeze(-1)


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
    """The blocked attention (arguments: ``kernels.attention.consistent_attention``); under grad, the
    gradient is recomputed per query tile (``_RecomputeBackward``)."""
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return _blocked_attention(q, k, v, scale, causal, q_positions, excluded, block_size, row_multiple, split_size)
    return _RecomputeBackward.apply(q, k, v, (scale, causal, q_positions, excluded, block_size, row_multiple,
                                              split_size))


class _RecomputeBackward(torch.autograd.Function):
    """The blocked forward (bitwise contract) with the gradient of plain softmax attention,
    recomputed in backward from q, k, v tile by tile (as flash attention does): nothing per key
    block is kept for backward, and a few batched tile backwards replace differentiating the loop.
    Only the forward must be layout-invariant; the gradient is exact attention's up to rounding."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        ctx.save_for_backward(q, k, v)
        ctx.args = args
        return _blocked_attention(q, k, v, *args)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        scale, causal, q_positions, excluded, block_size = ctx.args[:5]
        sq, sk = q.shape[2], k.shape[2]
        starts = range(0, sq, block_size)
        if q_positions is None:  # the last sq of sk positions: each tile's key extent known on the host
            q_positions = torch.arange(sk - sq, sk, device=q.device)
            extents = [sk - sq + min(sq, start + block_size) for start in starts]
        elif causal:  # one host read for every tile's key extent (its largest position + 1), not one per tile
            tiles = -(-sq // block_size)
            padded = torch.full((tiles * block_size,), -1, dtype=q_positions.dtype, device=q_positions.device)
            padded[:sq] = q_positions
            extents = [int(e) + 1 for e in padded.view(tiles, block_size).amax(-1).tolist()]
        if not causal:
            extents = [sk] * len(starts)
        need = ctx.needs_input_grad[:3]
        totals = [torch.zeros_like(t, dtype=torch.float32) if n else None for t, n in zip((q, k, v), need)]
        # Query tiles of block_size rows, each over the keys up to its last position (causal):
        # half the work of one full pass, and only a tile's scores alive at a time.
        for start, keys in zip(starts, extents):
            stop = min(sq, start + block_size)
            pos = q_positions[start:stop]
            ex = excluded
            if ex is not None:
                ex = ex[..., start:stop, :keys] if ex.shape[-2] == sq else ex[..., :keys]
            parts = [q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys]]
            parts = [t.detach().requires_grad_(n) for t, n in zip(parts, need)]
            with torch.enable_grad():
                out = _math_attention(*parts, scale, causal, pos, ex)
                grads = iter(torch.autograd.grad(out, [t for t in parts if t.requires_grad], grad[:, :, start:stop]))
            for total, n, rows in zip(totals, need, (slice(start, stop), slice(0, keys), slice(0, keys))):
                if n:
                    total[:, :, rows] += next(grads)
        return tuple(t.to(x.dtype) if t is not None else None for t, x in zip(totals, (q, k, v))) + (None,)


def _math_attention(q, k, v, scale, causal, q_positions, excluded):
    """softmax(q k^T * scale, hidden keys masked) v in fp32 over all keys at once; queries that see
    no key give 0 (as the blocked kernel does)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if q_positions is None:
        q_positions = torch.arange(sk - sq, sk, device=q.device)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible = torch.arange(sk, device=q.device).unsqueeze(0) <= q_positions.unsqueeze(1)
    if excluded is not None:
        visible = visible & ~excluded.to(torch.bool)[..., :sk]
    visible = visible.expand(b, hq, sq, sk)
    any_visible = visible.any(-1, keepdim=True)
    scores = torch.where(visible, scores, float("-inf"))
    scores = torch.where(any_visible, scores, 0.0)
    probs = torch.softmax(scores, dim=-1) * any_visible
    return torch.matmul(probs, vf).to(q.dtype)


def _blocked_attention(
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
    """consistent_attention's forward on the torch backend (see there): key blocks with an online
    softmax."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not divisible by key/value heads {hkv}")
    g = hq // hkv
    device = q.device
    if q_positions is None:
        q_positions = torch.arange(sk - sq, sk, device=device)
    if causal and sq > block_size and bool((q_positions[1:] >= q_positions[:-1]).all()):
        # Tile the queries by key block: a query never visits blocks past its own position, so
        # each tile stops early. Per-row results are unchanged (row-invariant GEMMs, and an
        # invisible block contributes exactly nothing), the work for a causal pass halves.
        tiles = torch.div(q_positions, block_size, rounding_mode="floor")
        outs, start = [], 0
        for tile in torch.unique_consecutive(tiles).tolist():
            stop = start + int((tiles == tile).sum())
            ex = excluded
            if ex is not None and ex.shape[-2] == sq:  # per-query masks follow their rows
                ex = ex[..., start:stop, :]
            outs.append(_blocked_attention(q[:, :, start:stop], k, v, scale, causal, q_positions[start:stop], ex,
                                             block_size, row_multiple, split_size))
            start = stop
        return torch.cat(outs, dim=2)
    nblk = -(-sk // block_size)
    if causal:  # blocks past the last query's position hold no visible key
        nblk = min(nblk, int(q_positions.max()) // block_size + 1)
    span = nblk * block_size
    kp = _pad_keys(k[:, :, :span], span).reshape(b * hkv, span, d)
    vp = _pad_keys(v[:, :, :span], span).reshape(b * hkv, span, d)
    # Rows are (group member, query): query head h uses key/value head h // g.
    qf = q.reshape(b * hkv, g * sq, d)
    rows = g * sq
    if excluded is not None:
        excluded = excluded.to(torch.bool)
        excluded = excluded[..., :span]
        if excluded.shape[-1] < span:
            pad = excluded.new_ones(*excluded.shape[:-1], span - excluded.shape[-1])
            excluded = torch.cat([excluded, pad], dim=-1)

    if split_size is not None and (split_size < block_size or split_size % block_size):
        raise ValueError(f"split_size={split_size} must be a positive multiple of block_size={block_size}")
    per_split = nblk if split_size is None else split_size // block_size

    def fresh():
        return (torch.full((b * hkv, rows), float("-inf"), device=device),
                torch.zeros((b * hkv, rows), device=device),
                torch.zeros((b * hkv, rows, d), device=device))

    m, l, acc = fresh()
    total = None
    for j in range(nblk):
        if j and j % per_split == 0:  # close a split: merge it into the running total, in order
            total = (m, l, acc) if total is None else _merge(total, (m, l, acc))
            m, l, acc = fresh()
        lo, hi = j * block_size, (j + 1) * block_size
        key_pos = torch.arange(lo, hi, device=device)
        visible = (key_pos < sk).unsqueeze(0).expand(sq, block_size)
        if causal:
            visible = visible & (key_pos.unsqueeze(0) <= q_positions.unsqueeze(1))
        visible = visible.repeat(g, 1).unsqueeze(0)  # (1, rows, B)
        if excluded is not None:
            ex = excluded[..., lo:hi].expand(b, 1, sq, block_size)
            ex = ex.unsqueeze(2).expand(b, hkv, g, sq, block_size).reshape(b * hkv, rows, block_size)
            visible = visible & ~ex
        scores = matmul(qf, kp[:, lo:hi].transpose(-1, -2), row_multiple) * scale
        scores = torch.where(visible, scores, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = exp(scores - m_safe.unsqueeze(-1))
        alpha = exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + matmul(p, vp[:, lo:hi], row_multiple)
        m = m_new
    if total is not None:
        m, l, acc = _merge(total, (m, l, acc))
    out = torch.where(l.unsqueeze(-1) > 0, acc / l.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1), 0.0)
    return out.reshape(b, hq, sq, d).to(q.dtype)


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
    """Causal attention of the newest queries over a paged KV cache (the rollout decode step).

    q (b, hq, sq, d): the last sq tokens of each request; k_cache/v_cache (num_pages, page_size,
    hkv, d); page_table (b, pages per request) page ids in order; cache_seqlens (b,) keys held per
    request, the new tokens included. Returns (b, hq, sq, d). Each request's keys are gathered and
    run through ``attention``, so decode equals the training forward bitwise.
    """
    page_size = k_cache.shape[1]
    outs = []
    for i in range(q.shape[0]):
        n = int(cache_seqlens[i])
        pages = page_table[i, : -(-n // page_size)].long()
        keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n].permute(1, 0, 2).unsqueeze(0)
        values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n].permute(1, 0, 2).unsqueeze(0)
        outs.append(attention(q[i : i + 1], keys, values, scale, causal=True, block_size=block_size,
                              row_multiple=row_multiple, split_size=split_size))
    return torch.cat(outs, dim=0)
