"""The torch reference backend: every primitive kernel in plain torch (CPU, always tested).

These define the primitives' semantics; other backends (``npu.py``) implement the same names.
- GEMMs: a row of the output depends only on that row of the input and on the weights, never on how
  many rows were computed together, on which column shard a rank holds, nor on the thread count. CPU
  BLAS libraries pick their kernel, and with it the K order, from the call's shape and the threads
  it may use (MKL and oneDNN switch paths for small or odd M, for column tails, per ISA -- AVX2,
  AVX-512, AVX-512-BF16, AMX, where bf16 moves to the AMX tiles past a few dozen rows -- and split K
  across threads when M x N is small). So the library never sees a shape or a thread count that the
  problem does not fix: the product is cut into tiles of ``ROW_TILE`` rows (the last zero-padded) by
  ``COLUMN_TILE`` output columns (the last zero-padded), and every tile is one single-threaded
  library call of that one shape on 64-byte-aligned operands in one layout, the tiles run in parallel
  across the caller's threads (``one_thread_pieces``). A column a rank holds is then computed by the
  call the full weight makes for it, a row by the same call whatever rows were beside it (tested over
  every M to 512, K to 8192, column tails, 1-8 threads, fp32 and bf16, forward and gradient GEMMs,
  under every oneDNN / MKL ISA limit the host can emulate, in tests/test_gemm_invariance.py, which
  names the CPU it ran on). CPU only: dispatch refuses CUDA tensors.
- Attention: per query and head, fp32 scores, keys visited in fixed blocks of ``block_size``
  aligned to absolute key positions, online softmax in fp32, invisible keys excluded by select
  (never a large negative additive mask), one final division and one cast. A fully invisible block
  contributes exactly nothing (rescale factor exp(0) = 1, zero probabilities), so a caller that
  stops early at the last visible block -- a decode step -- gets the same bits as training.
"""
import math
import threading
from typing import Optional

import torch

from .. import one_thread_pieces
from ..elementwise import exp

# Explicit (padding) attention masks are honoured by this backend's attention.
EXPLICIT_MASKS = True


# Rows of every GEMM call: a multiple of every profile's ``gemm_row_multiple`` (16) and of every x86
# micro-kernel's row block; past the row counts at which the libraries change kernel (AMX: 17-33).
ROW_TILE = 128
# The output columns one linear call computes: a multiple of every x86 BLAS micro-kernel's panel width
# (8, 16, 24, 32, 48, 64, 96, 128), so no call has a panel tail inside it and a column's bits do not
# depend on its position in the tile (the sweeps cut shards that start mid-tile). 512 was not: MKL's
# AVX2 sgemm on Intel packs 24-wide panels, and the 8 columns of a 512-tile's tail panel came out
# with other bits than the same columns mid-panel (a TP shard's columns differed from the full
# weight's; measured on a Xeon under MKL_ENABLE_INSTRUCTIONS=AVX2, an Intel CPU without AVX-512).
# Each call packs its (ROW_TILE, K) rows again: at 512 columns that cost 5-8 % of a real projection's
# time, at 128 columns 12-20 % (K 1024-3072, fp32 and bf16, AVX-512-BF16 Zen 4). 384 against 512 on the
# AMX Xeon (M 4096, K 1024-2048, N 1024-4096, 2 threads): fp32 -4 % to +11 %, bf16 +4 % to +40 %, mostly
# the zero-padded columns where N is a multiple of 512 but not of 384 (12.5 % at N 1024 or 2048).
COLUMN_TILE = 384
# The CPU allocator's alignment (c10's 64 bytes): every operand a library call sees starts on it.
_ALIGN = 64


# Rows of a transposed operand copied per block (``_whole``): a plain copy of a (K, N) view with row
# stride 1 walks the source a stride apart per element (230 ms for a row-parallel leaf's 2048 x 7168,
# 95 ms in blocks of 64 source rows); a copy moves values, whatever its order, the same bits.
_TRANSPOSE_BLOCK = 64
_BLOCKED_FROM = 1 << 20  # elements: below, the plain copy is as fast


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous, 64-byte-aligned matrix (a copy only where it is not one)."""
    if t.is_contiguous() and t.data_ptr() % _ALIGN == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype)
    if t.dim() == 2 and t.stride(0) == 1 and t.numel() >= _BLOCKED_FROM:
        rows = t.t()  # (N, K), its rows strided: each block gathered contiguous, then transposed into place
        for start in range(0, rows.shape[0], _TRANSPOSE_BLOCK):
            out[:, start:start + _TRANSPOSE_BLOCK].copy_(rows[start:start + _TRANSPOSE_BLOCK].contiguous().t())
        return out
    return out.copy_(t)


def _row_tiles(a: torch.Tensor) -> torch.Tensor:
    """``a`` (..., M, K) with M zero-padded to whole ROW_TILEs, contiguous and aligned, so that every
    row tile starts on the alignment too (ROW_TILE * K * itemsize is a multiple of 64)."""
    rows = a.shape[-2]
    padded = -(-rows // ROW_TILE) * ROW_TILE
    if padded == rows:
        return _whole(a)
    out = a.new_zeros(*a.shape[:-2], padded, a.shape[-1])
    out[..., :rows, :].copy_(a)
    return out


def _check_call(row_multiple: int, *operands: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        raise RuntimeError("the torch backend's GEMMs are forward-only: differentiate them through "
                           "kernels.linear.with_plain_backward (as invariant_linear does)")
    if row_multiple < 1 or ROW_TILE % row_multiple:
        raise ValueError(f"profile field 'gemm_row_multiple'={row_multiple} must divide the torch backend's "
                         f"row tile {ROW_TILE}: set it to 16 (the bundled profiles' value)")


def matmul(a: torch.Tensor, b: torch.Tensor, row_multiple: int = 16) -> torch.Tensor:
    """fp32 ``a @ b`` for ``a`` (..., M, K) and ``b`` (..., K, N) or (K, N), row-invariant in M: one
    single-threaded (ROW_TILE, K) x (K, N) call per batch entry and row tile."""
    _check_call(row_multiple, a, b)
    a, b = a.float(), b.float()
    batch = a.shape[:-2] if b.dim() == 2 or a.shape[:-2] == b.shape[:-2] else torch.broadcast_shapes(
        a.shape[:-2], b.shape[:-2])
    rows, n, entries = a.shape[-2], b.shape[-1], math.prod(batch)
    if rows == 0 or n == 0 or entries == 0:
        return a.new_zeros(*batch, rows, n)
    a3 = _row_tiles(a.expand(*batch, *a.shape[-2:]).reshape(entries, *a.shape[-2:]))
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(entries, *b.shape[-2:])
    tiles = a3.shape[1] // ROW_TILE
    lhs = a3.view(entries, tiles, ROW_TILE, a3.shape[-1])
    rhs = [_operand(b3[i]) for i in range(entries)]
    # Each whole tile's product lands in place: a (ROW_TILE, n) block of a contiguous output is laid
    # out as a fresh one (leading dimension n), so the call is the same as into its own buffer. The
    # last, zero-padded tile lands in the thread's scratch block of that layout and only its real
    # rows are kept: a MoE expert's few dozen rows need no fresh (ROW_TILE, n) buffer per call (the
    # first touch of its pages cost more than the product).
    out = a3.new_empty(entries, rows, n)
    full = rows // ROW_TILE

    def piece(p):
        i, j = p
        if j < full:
            torch.mm(lhs[i, j], rhs[i], out=out[i, j * ROW_TILE:(j + 1) * ROW_TILE])
        else:
            block = _scratch(n, a3.dtype)
            torch.mm(lhs[i, j], rhs[i], out=block)
            out[i, j * ROW_TILE:].copy_(block[:rows - j * ROW_TILE])

    one_thread_pieces.run_pieces(piece, [(i, j) for i in range(entries) for j in range(tiles)])
    return out.reshape(*batch, rows, n)


_scratch_blocks = threading.local()


def _scratch(n: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's (ROW_TILE, n) output block, contiguous and aligned, kept for reuse."""
    blocks = getattr(_scratch_blocks, "by_shape", None)
    if blocks is None:
        blocks = _scratch_blocks.by_shape = {}
    block = blocks.get((n, dtype))
    if block is None:
        block = blocks[(n, dtype)] = torch.empty((ROW_TILE, n), dtype=dtype)
    return block


def _operand(b: torch.Tensor) -> torch.Tensor:
    """A (K, N) right operand in one of the two layouts a library reads by shape alone: row-major, or
    the transpose of a row-major (N, K) (its leading dimension K); aligned. Anything else is copied."""
    if b.t().is_contiguous() and b.data_ptr() % _ALIGN == 0:
        return b
    return _whole(b)


def linear(x2d: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, row_multiple: int = 16) -> torch.Tensor:
    """``x2d @ weight.T`` accumulated in fp32, cast once to ``out_dtype`` (forward, and bitwise training's
    gradient GEMMs): one single-threaded library call of shape (ROW_TILE, K) x (K, COLUMN_TILE) per tile."""
    _check_call(row_multiple, x2d, weight)
    rows, n = x2d.shape[0], weight.shape[0]
    # CPU bf16: oneDNN's bf16 GEMM accumulates in fp32 and rounds once, 2-2.5x faster than an fp32 GEMM
    # of upcast inputs (5x with native AVX-512-BF16 / AMX); invariant at fixed shapes and one thread.
    native_bf16 = x2d.dtype == weight.dtype == out_dtype == torch.bfloat16 and x2d.device.type == "cpu"
    # One operand layout for every call: row tiles row-major (a weight gradient's dy^T copied once),
    # weight tiles row-major (N, K) read transposed (a weight gradient's x^T tiles copied).
    a = _row_tiles(x2d if native_bf16 else x2d.float())
    w = weight if native_bf16 else weight.float()
    out = torch.empty((rows, n), dtype=out_dtype)
    if rows == 0 or n == 0:
        return out
    tiles = [w[start:start + COLUMN_TILE] for start in range(0, n, COLUMN_TILE)]
    if tiles[-1].shape[0] < COLUMN_TILE:
        tiles[-1] = torch.cat([tiles[-1], tiles[-1].new_zeros(COLUMN_TILE - tiles[-1].shape[0], w.shape[1])])
    tiles = [_whole(t) for t in tiles]

    def tile(piece):
        r, c = piece
        product = torch.mm(a[r:r + ROW_TILE], tiles[c].t())
        start = c * COLUMN_TILE
        out[r:r + ROW_TILE, start:start + COLUMN_TILE].copy_(product[:rows - r, :n - start])

    one_thread_pieces.run_pieces(tile, [(r, c) for r in range(0, rows, ROW_TILE) for c in range(len(tiles))])
    return out


def grouped_linear(xs, weights, out_dtype: torch.dtype, row_multiple: int = 16):
    """``[linear(x, w, out_dtype) for x, w in zip(xs, weights)]``, the same bits, in fewer library calls:
    weights of at most COLUMN_TILE rows are packed side by side into shared column tiles and their
    products' rows stacked into shared row tiles, so many small products (a MoE layer's experts: 128
    output rows, a few dozen token rows each) fill the (ROW_TILE, K) x (K, COLUMN_TILE) calls that
    ``linear`` would mostly pad with zeros. Every call has ``linear``'s one shape, layout and
    alignment; only a row's or a column's position inside its tile changes, which does not change its
    bits (tests/test_gemm_invariance.py: shards starting mid-tile, rows shifted within a tile)."""
    pairs = list(zip(xs, weights))
    results = [None] * len(pairs)
    groups, group, width = [], [], 0
    for i, (x, w) in enumerate(pairs):
        _check_call(row_multiple, x, w)
        same = (x.dtype, w.dtype, x.shape[1]) == (pairs[0][0].dtype, pairs[0][1].dtype, pairs[0][0].shape[1])
        if w.shape[0] > COLUMN_TILE or not same or x.shape[0] == 0 or w.shape[0] == 0:
            results[i] = linear(x, w, out_dtype, row_multiple)  # its own calls, as before
            continue
        if width + w.shape[0] > COLUMN_TILE:
            groups.append(group)
            group, width = [], 0
        group.append(i)
        width += w.shape[0]
    if group:
        groups.append(group)
    if not groups:
        return results
    first_x, first_w = pairs[groups[0][0]]
    native_bf16 = first_x.dtype == first_w.dtype == out_dtype == torch.bfloat16 and first_x.device.type == "cpu"
    dtype = first_x.dtype if native_bf16 else torch.float32
    k = first_x.shape[1]

    def group_calls(members):  # one group's operands packed (zero-padded, aligned) only while it runs
        rows = sum(pairs[i][0].shape[0] for i in members)
        a = torch.zeros((-(-rows // ROW_TILE) * ROW_TILE, k), dtype=dtype)
        tile = torch.zeros((COLUMN_TILE, k), dtype=dtype)
        places, r, c = [], 0, 0
        for i in members:
            x, w = pairs[i]
            a[r:r + x.shape[0]].copy_(x)
            tile[c:c + w.shape[0]].copy_(w)
            places.append((i, r, c))
            r, c = r + x.shape[0], c + w.shape[0]
        out = torch.empty((a.shape[0], COLUMN_TILE), dtype=out_dtype)
        for r in range(0, a.shape[0], ROW_TILE):
            out[r:r + ROW_TILE].copy_(torch.mm(a[r:r + ROW_TILE], tile.t()))
        for i, r, c in places:
            results[i] = out[r:r + pairs[i][0].shape[0], c:c + pairs[i][1].shape[0]].clone()

    one_thread_pieces.run_pieces(group_calls, groups)
    return results


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
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The blocked attention (arguments: ``kernels.attention.consistent_attention``); under grad, the
    gradient is recomputed per query tile (``_RecomputeBackward``)."""
    grads = [t is not None and t.requires_grad for t in (q, k, v, sinks)]
    if not (torch.is_grad_enabled() and any(grads)):
        return _blocked_attention(q, k, v, scale, causal, q_positions, excluded, block_size, row_multiple, split_size,
                                  window, sinks)
    return _RecomputeBackward.apply(q, k, v, sinks, (scale, causal, q_positions, excluded, block_size, row_multiple,
                                                     split_size, window))


class _RecomputeBackward(torch.autograd.Function):
    """The blocked forward (bitwise contract) with the gradient of plain softmax attention,
    recomputed in backward from q, k, v tile by tile (as flash attention does): nothing per key
    block is kept for backward, and a few batched tile backwards replace differentiating the loop.
    Only the forward must be layout-invariant; the gradient is exact attention's up to rounding."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, args):
        ctx.save_for_backward(q, k, v, sinks)
        ctx.args = args
        return _blocked_attention(q, k, v, *args, sinks)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks = ctx.saved_tensors
        scale, causal, q_positions, excluded, block_size = ctx.args[:5]
        window = ctx.args[7]
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
        need_sinks = sinks is not None and ctx.needs_input_grad[3]
        # a sink's gradient per (batch, head, query), summed per head in one fixed order at the end
        sink_terms = q.new_zeros(q.shape[0], q.shape[1], sq, dtype=torch.float32) if need_sinks else None
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
            tile_sinks = None
            if sinks is not None:  # one leaf per (batch, head, query): the per-query terms kept apart
                tile_sinks = sinks.detach().float().view(1, -1, 1, 1).expand(q.shape[0], -1, stop - start, 1)
                tile_sinks = tile_sinks.contiguous().requires_grad_(need_sinks)
            with torch.enable_grad():
                out = _math_attention(*parts, scale, causal, pos, ex, window, tile_sinks)
                leaves = [t for t in parts if t.requires_grad] + ([tile_sinks] if need_sinks else [])
                grads = iter(torch.autograd.grad(out, leaves, grad[:, :, start:stop]))
            for total, n, rows in zip(totals, need, (slice(start, stop), slice(0, keys), slice(0, keys))):
                if n:
                    total[:, :, rows] += next(grads)
            if need_sinks:
                sink_terms[:, :, start:stop] = next(grads).squeeze(-1)
        dsinks = None
        if need_sinks:  # per head over (batch, query) in that order: the same terms in any head split
            dsinks = row_sum(sink_terms.transpose(0, 1).reshape(sink_terms.shape[1], -1)).to(sinks.dtype)
        return tuple(t.to(x.dtype) if t is not None else None for t, x in zip(totals, (q, k, v))) + (dsinks, None)


def _math_attention(q, k, v, scale, causal, q_positions, excluded, window=None, sinks=None):
    """softmax(q k^T * scale, hidden keys masked) v in fp32 over all keys at once; queries that see
    no key give 0 (as the blocked kernel does). ``sinks``: a logit per head (hq,) or per (b, hq, sq, 1)
    in the softmax's denominator with no value (gpt-oss' attention sinks)."""
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
    if window is not None:
        visible = visible & (torch.arange(sk, device=q.device).unsqueeze(0) >= q_positions.unsqueeze(1) - window)
    if excluded is not None:
        visible = visible & ~excluded.to(torch.bool)[..., :sk]
    visible = visible.expand(b, hq, sq, sk)
    scores = torch.where(visible, scores, float("-inf"))
    if sinks is not None:  # the sink column keeps every row finite; a row that sees no key gives 0
        sink_column = sinks.float().reshape(-1, hq, 1, 1) if sinks.dim() == 1 else sinks.float()
        probs = torch.softmax(torch.cat([scores, sink_column.expand(b, hq, sq, 1)], dim=-1), dim=-1)[..., :sk]
        return torch.matmul(probs, vf).to(q.dtype)
    any_visible = visible.any(-1, keepdim=True)
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
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """consistent_attention's forward on the torch backend (see there): key blocks with an online
    softmax; ``window``: keys more than that many positions before a query are hidden (sliding-window
    attention; a block wholly before the window adds exactly nothing, as a causally hidden one). The
    value head size may differ from the query / key one (multi-latent attention: 128 vs 192).
    ``sinks`` (hq,): each head's sink logit joins the softmax state once, after every key block."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
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
                                             block_size, row_multiple, split_size, window, sinks))
            start = stop
        return torch.cat(outs, dim=2)
    nblk = -(-sk // block_size)
    if causal:  # blocks past the last query's position hold no visible key
        nblk = min(nblk, int(q_positions.max()) // block_size + 1)
    span = nblk * block_size
    kp = _pad_keys(k[:, :, :span], span).reshape(b * hkv, span, d)
    vp = _pad_keys(v[:, :, :span], span).reshape(b * hkv, span, dv)
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
                torch.zeros((b * hkv, rows, dv), device=device))

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
        if window is not None:
            visible = visible & (key_pos.unsqueeze(0) >= q_positions.unsqueeze(1) - window)
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
    if sinks is not None:  # the sink as one more key with no value, after every block (rows: kv head, member, query)
        sink = sinks.float().reshape(hkv, g, 1).expand(hkv, g, sq).reshape(1, hkv, rows).expand(b, hkv, rows)
        sink = sink.reshape(b * hkv, rows)
        m_new = torch.maximum(m, sink)
        alpha = exp(m - m_new)
        l = l * alpha + exp(sink - m_new)
        acc = acc * alpha.unsqueeze(-1)
    out = torch.where(l.unsqueeze(-1) > 0, acc / l.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1), 0.0)
    return out.reshape(b, hq, sq, dv).to(q.dtype)


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
                              row_multiple=row_multiple, split_size=split_size, window=window, sinks=sinks))
    return torch.cat(outs, dim=0)
