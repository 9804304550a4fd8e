"""The Triton kernels of the triton backend (``backends/triton.py`` shapes the calls).

Every kernel's tiling is a constant of this module, chosen from the input dtype only, never from a
shape: a program computes a fixed tile and visits its reduction dimension in a fixed order, so an
output element depends only on its own row (and column) of the inputs. What changes with M, N or
the batch is how many programs run, not what any of them computes.

Imported only when the triton backend runs (it needs ``triton``). Under Triton's interpreter
(``TRITON_INTERPRET=1`` when this module is imported) the kernels run on CPU tensors with numpy;
the interpreter's ``tl.dot`` is numpy's BLAS matmul, whose result for a row depends on where the
row sits in the tile (OpenBLAS micro-kernels), and it mishandles bf16 tiles (it multiplies their raw
bits). So there ``tile_dot`` upcasts to fp32 and sums the products over K in order, the same for
every element; the tiling, masking and visiting order around it are the compiled kernel's.
Its fp32 -> bf16 cast does not round to nearest even either, so there the kernels write fp32 and
the wrapper casts. Compiled, ``tile_dot`` is ``tl.dot``: bf16 tiles on the tensor cores with fp32 accumulation, fp32
tiles with ``input_precision="ieee"`` (never TF32).

Every kernel is one compiled variant per numerics, by construction, so a launch from training (any
layout, any mask), chunked prefill, paged decode, packed sequences or CP compiles to the code of
every other launch with the same constexprs (dtype, head dim, tiles): no integer argument (size,
stride, flag) is specialised (``do_not_specialize``), nor the alignment of a pointer the wrappers do
not align (``do_not_specialize_on_alignment``); the tensors they do align (16-byte base, unit inner
stride, copying otherwise) specialise alike at every launch, and their strides arrive in 16-byte
units (``stride * VEC`` here), so the kernels know that alignment from their code, not from a value.
Sums whose order matters (``pairwise_sum``) add in a tree written here, not in the order of the
layout the compiler picks for the block; maxima are exact in any order. FP contraction is pinned at
launch (``LAUNCH``), not left to Triton's default.
scripts/compile_triton_kernels.py compiles every call site's specialisation for sm_90/sm_80 on a CPU
and checks this (tests/test_triton_compiled.py).
"""
import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# GEMM tiles: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages). No split-K: one
# program owns an output tile and runs the whole K loop, BLOCK_K at a time, in order.
GEMM_TILES_HALF = (128, 128, 64, 8, 8, 3)  # bf16 / fp16 inputs: tensor cores, fp32 accumulator
GEMM_TILES_FP32 = (64, 64, 32, 8, 4, 3)  # fp32 inputs: IEEE fp32 FMA (no TF32)
# Row kernels: one program per row, BLOCK elements per step, one fixed tree sum at the end.
ROW_BLOCK, ROW_WARPS = 1024, 4
# Attention tiles (BLOCK_Q, num_warps, num_stages) by input dtype and GPU generation (9: sm_90 and
# later, 8: before): BLOCK_Q queries of one (batch, head) per program; key tiles are the profile's
# block. fp32's two products and every P @ V (fp32 probabilities) are FMA on CUDA cores with their
# operands in registers: these tiles keep them there at head dims 32-128 (no stack in the cubin,
# scripts/compile_triton_kernels.py); 64-query tiles spilled 0.2-10 KB per thread.
ATTN_TILES = {("half", 9): (32, 8, 2), ("half", 8): (32, 16, 2), ("fp32", 9): (16, 8, 2), ("fp32", 8): (16, 8, 2)}
# FP contraction (a*b+c as one FMA) pinned at every launch: Triton's default is a knob that changes
# between versions (3.10 turns it off), and it changes the bits of every kernel.
FP_FUSION = True
LAUNCH = {"enable_fp_fusion": FP_FUSION}
# What the wrappers guarantee of every tensor a kernel reads (copying otherwise): a 16-byte
# aligned base and strides, the innermost stride 1. ``VEC`` = 16 bytes in elements of the input.
ALIGN_BYTES = 16


@triton.jit
def tile_dot(x, y, acc, INTERPRETED: tl.constexpr):
    """acc + x @ y with fp32 accumulation (see the module docstring for the interpreter's form)."""
    if INTERPRETED:
        return acc + tl.sum(x.to(tl.float32)[:, :, None] * y.to(tl.float32)[None, :, :], axis=1)
    if x.dtype == tl.float32:
        return tl.dot(x, y, acc, input_precision="ieee")
    return tl.dot(x, y, acc)


@triton.jit
def pairwise_sum(x):
    """Sum of a 1-D block (a power of 2 long) in a tree written here: element c plus element
    c + W/2, then the same on the half, down to one. The pairing is the source's, so no layout the
    compiler chooses for ``x`` (elements per thread, threads per warp) changes the order."""
    for _ in tl.static_range(20):
        if x.shape[0] > 1:
            x = tl.sum(tl.reshape(x, (2, x.shape[0] // 2)), axis=0)  # two elements: one add, any order
    return tl.sum(x, axis=0)  # one element: no add


@triton.jit
def pairwise_row_sum(x):
    """``pairwise_sum`` of every row of a 2-D block (the row length a power of 2)."""
    for _ in tl.static_range(20):
        if x.shape[1] > 1:
            x = tl.sum(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), axis=1)
    return tl.sum(x, axis=1)


@triton.jit(do_not_specialize=["M", "N", "K", "stride_ab", "stride_am", "stride_bb", "stride_bn", "stride_cb",
                               "stride_cm"],
            do_not_specialize_on_alignment=["bias_ptr"])
def gemm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_ab, stride_am,
    stride_bb, stride_bn,
    stride_cb, stride_cm,
    HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, VEC: tl.constexpr,
    C_VEC: tl.constexpr,
):
    """c[batch] = a[batch] @ b[batch] (+ bias), fp32 accumulator, one cast to c's dtype.

    a (batch, M, K) and b, stored as (batch, N, K), both unit-stride in K; c (batch, M, N) unit-stride
    in N. The wrapper guarantees 16-byte aligned bases and batch/row strides (VEC / C_VEC elements of
    a / c) and K a multiple of VEC (zero-padded: the masked tail reads zeros anyway)."""
    K = K * VEC
    stride_ab = stride_ab * VEC
    stride_am = stride_am * VEC
    stride_bb = stride_bb * VEC
    stride_bn = stride_bn * VEC
    stride_cb = stride_cb * C_VEC
    stride_cm = stride_cm * C_VEC
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    # Grouped tile order for L2 reuse: which program computes a tile, never how.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    a_tile = a_ptr + batch * stride_ab + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_tile = b_ptr + batch * stride_bb + rk[:, None] + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(a_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.load(b_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tile_dot(x, y, acc, INTERPRETED)
        a_tile += BLOCK_K
        b_tile += BLOCK_K
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c_tile = c_ptr + batch * stride_cb + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_tile, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["N", "stride_row"], do_not_specialize_on_alignment=["out_ptr"])
def row_sum_kernel(x_ptr, out_ptr, N, stride_row, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """out[row] = fp32 sum of x[row, :N]: BLOCK-wide partial sums in order, then ``pairwise_sum``.
    x: unit-stride rows, 16-byte aligned base and row stride (the wrapper's guarantee)."""
    stride_row = stride_row * VEC
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    base = x_ptr + row * stride_row
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        acc += tl.load(base + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, pairwise_sum(acc))


@triton.jit(do_not_specialize=["N", "stride_x", "stride_out"], do_not_specialize_on_alignment=["out_ptr"])
def softmax_kernel(x_ptr, out_ptr, N, stride_x, stride_out, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """out[row] = softmax(x[row]) in fp32: exact max, row_sum_kernel's order for the sum of exp.
    x as row_sum_kernel's; out: fp32 rows, unit stride."""
    stride_x = stride_x * VEC
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    base = x_ptr + row * stride_x
    running = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < N, other=float("-inf")).to(tl.float32)
        running = tl.maximum(running, x)
    top = tl.max(running, axis=0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < N, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - top)
    total = pairwise_sum(acc)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        x = tl.load(base + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * stride_out + start + cols, tl.exp(x - top) / total, mask=ok)


@triton.jit
def _merge_state(m1, l1, acc1, m2, l2, acc2):
    """Two online-softmax states over disjoint key sets, the first one's keys before the second's."""
    m = tl.maximum(m1, m2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s1 = tl.exp(m1 - m_safe)
    s2 = tl.exp(m2 - m_safe)
    return m, l1 * s1 + l2 * s2, acc1 * s1[:, None] + acc2 * s2[:, None]


# Every integer argument of attention_kernel: none is specialised (a size, a stride, a flag).
_ATTN_INTS = ["sq", "hq", "group", "block", "per_split", "page_size", "causal", "s_qb", "s_qh", "s_qs", "s_kp",
              "s_ko", "s_kh", "s_vp", "s_vo", "s_vh", "s_ob", "s_oh", "s_os", "s_pb", "s_tb"]


@triton.jit(do_not_specialize=_ATTN_INTS,
            do_not_specialize_on_alignment=["pos_ptr", "seqlen_ptr", "table_ptr"])
def attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, seqlen_ptr, table_ptr,
    sq, hq, group, scale, block, per_split, page_size, causal,
    s_qb, s_qh, s_qs,
    s_kp, s_ko, s_kh,
    s_vp, s_vo, s_vh,
    s_ob, s_oh, s_os,
    s_pb, s_tb,
    D: tl.constexpr, SPLIT: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
    O_VEC: tl.constexpr,
):
    """Consistent attention for BLOCK_Q queries of one (batch, head), every mode in one code path.

    Keys are addressed through pages: key ``t`` of batch entry ``b`` lives in page
    ``table[b, t // page_size]`` at offset ``t % page_size`` (training passes each sequence as one
    page). Entry ``b`` has ``seqlen[b]`` keys (padding is a shorter length, never a mask). Key blocks
    ``[j*block, (j+1)*block)`` are aligned to absolute positions; each query's procedure (scores in
    fp32, invisible keys excluded by select, online softmax in fp32, the sum of a block's
    probabilities by ``pairwise_row_sum``) depends only on its own position and the keys, so a block
    past its last visible key is an exact no-op (rescale exp(0) = 1, zero probabilities) and a tile
    may stop at its last query's block. With SPLIT, every ``per_split`` blocks form a split with its
    own state, merged into the running total in split order.

    q/k/v/o: unit stride in the head dim, 16-byte aligned bases and strides; positions and the page
    table: unit stride along a row (the wrapper's guarantees).
    """
    s_qb = s_qb * VEC
    s_qh = s_qh * VEC
    s_qs = s_qs * VEC
    s_kp = s_kp * VEC
    s_ko = s_ko * VEC
    s_kh = s_kh * VEC
    s_vp = s_vp * VEC
    s_vo = s_vo * VEC
    s_vh = s_vh * VEC
    s_ob = s_ob * O_VEC
    s_oh = s_oh * O_VEC
    s_os = s_os * O_VEC
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // hq
    h = bh % hq
    hk = h // group
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < sq
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + h * s_qh + rows[:, None] * s_qs + dims[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = tl.load(pos_ptr + b * s_pb + rows, mask=row_ok, other=-1)
    n_keys = tl.load(seqlen_ptr + b)
    n_blocks = tl.cdiv(n_keys, block)
    if causal != 0:  # blocks past the tile's last query hold no key any of its queries sees
        n_blocks = tl.minimum(n_blocks, tl.max(pos, axis=0) // block + 1)
    lanes = tl.arange(0, BLOCK_KEYS)
    lane_ok = lanes < block
    k_head = k_ptr + hk * s_kh
    v_head = v_ptr + hk * s_vh

    m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    if SPLIT:
        m_t = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
        l_t = tl.zeros((BLOCK_Q,), dtype=tl.float32)
        acc_t = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for j in range(0, n_blocks):
        if SPLIT:
            if j % per_split == 0:  # a split closes: merge it into the total (exact on an empty total)
                m_t, l_t, acc_t = _merge_state(m_t, l_t, acc_t, m, l, acc)
                m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
                l = tl.zeros((BLOCK_Q,), dtype=tl.float32)
                acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
        kpos = j * block + lanes
        key_ok = lane_ok & (kpos < n_keys)
        page = tl.load(table_ptr + b * s_tb + kpos // page_size, mask=key_ok, other=0).to(tl.int64)
        offset = (kpos % page_size).to(tl.int64)
        kt = tl.load(k_head + page[None, :] * s_kp + offset[None, :] * s_ko + dims[:, None],
                     mask=d_ok[:, None] & key_ok[None, :], other=0.0)
        vt = tl.load(v_head + page[:, None] * s_vp + offset[:, None] * s_vo + dims[None, :],
                     mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        scores = tile_dot(q, kt, tl.zeros((BLOCK_Q, BLOCK_KEYS), dtype=tl.float32), INTERPRETED) * scale
        # causal: a runtime flag, not a constexpr, so causal and non-causal calls share one binary
        visible = key_ok[None, :] & row_ok[:, None] & ((kpos[None, :] <= pos[:, None]) | (causal == 0))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + pairwise_row_sum(p)
        acc = tile_dot(p, vt.to(tl.float32), acc * alpha[:, None], INTERPRETED)
        m = m_new
    if SPLIT:
        m, l, acc = _merge_state(m_t, l_t, acc_t, m, l, acc)
    out = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1.1754943508222875e-38)[:, None], 0.0)
    tl.store(o_ptr + b.to(tl.int64) * s_ob + h * s_oh + rows[:, None] * s_os + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
