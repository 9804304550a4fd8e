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
stride, flag) is specialised (``do_not_specialize``) and each has a declared type (``I64`` strides,
``I32`` sizes and flags, never typed by its value), nor the alignment of a pointer the wrappers do
not align (``do_not_specialize_on_alignment``); the tensors they do align (16-byte base, unit inner
stride, copying otherwise) specialise alike at every launch, and their strides arrive in 16-byte
units (``stride * VEC`` here), so the kernels know that alignment from their code, not from a value.
Sums whose order matters (``pairwise_sum``) add in a tree written here, not in the order of the
layout the compiler picks for the block; maxima are exact in any order. FP contraction is pinned at
launch (``LAUNCH``), not left to Triton's default.
Attention's backward is three kernels (``attention_delta_kernel``, ``attention_dkdv_kernel``,
``attention_dq_kernel``): each gradient element has one writer and a fixed order, no atomics.
scripts/compile_triton_kernels.py compiles every call site's specialisation for sm_90/sm_80 on a CPU
and checks this, no spills and tensor-core products in bf16 (tests/test_triton_compiled.py).
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
# Attention forward tiles by input dtype and GPU generation (9: sm_90 and later, 8: before), each a
# list of (largest head dim, (BLOCK_Q, num_warps, num_stages)): BLOCK_Q queries of one (batch, head)
# per program; key tiles are the profile's block. bf16 / fp16: both products on tensor cores (P
# rounded to the input dtype before P @ V, as FlashAttention does), 128 query rows = two warpgroups'
# wgmma on sm_90. fp32: IEEE FMA on CUDA cores (no TF32). Chosen so that no head dim spills at
# Triton 3.6 (the GPU machines') or 3.9 (CI), sm_90 or sm_80 (scripts/compile_triton_kernels.py).
ATTN_TILES = {
    ("half", 9): ((128, (128, 8, 1)),),
    ("half", 8): ((128, (128, 8, 1)),),
    ("fp32", 9): ((64, (16, 16, 1)), (128, (32, 16, 1))),
    ("fp32", 8): ((64, (16, 16, 1)), (128, (32, 16, 1))),
}
# Attention backward tiles, keyed and listed as the forward's, per pass: "dkdv" (BLOCK_Q queries per
# step of a BLOCK_KEYS-key program) and "dq" (a BLOCK_Q-query program, BLOCK_KEYS keys per step),
# each (BLOCK_Q, BLOCK_KEYS, num_warps, num_stages). The backward's key tile is its own: not the
# forward's numerics (the profile's block), only the gradient's. dK / dV's products have the keys
# as rows (64: one wgmma), dQ's the queries.
ATTN_BWD_TILES = {
    ("half", 9): ((128, {"dkdv": (32, 64, 8, 1), "dq": (64, 64, 8, 2)}),),
    ("half", 8): ((128, {"dkdv": (32, 64, 8, 1), "dq": (64, 64, 8, 2)}),),
    ("fp32", 9): ((32, {"dkdv": (32, 32, 4, 1), "dq": (16, 16, 4, 2)}),
                  (64, {"dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 2)}),
                  (128, {"dkdv": (16, 32, 4, 1), "dq": (16, 16, 4, 2)})),
    ("fp32", 8): ((32, {"dkdv": (32, 32, 4, 1), "dq": (16, 16, 4, 2)}),
                  (64, {"dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 2)}),
                  (128, {"dkdv": (16, 32, 4, 1), "dq": (16, 16, 4, 2)})),
}


def tiles_for(table, key, head_dim):
    """The tiles of ``table[key]`` for a head dim: the first entry whose largest head dim covers it."""
    return next(tiles for largest, tiles in table[key] if head_dim <= largest)


# Head dims the attention kernels are compiled and checked for (scripts/compile_triton_kernels.py:
# one binary, no stack, tensor-core MMA in bf16); any other is refused by name (attention_head_dim_backend).
ATTN_HEAD_DIMS = (32, 64, 96, 128)
# FP contraction (a*b+c as one FMA) pinned at every launch: Triton's default is a knob that changes
# between versions (3.10 turns it off), and it changes the bits of every kernel.
FP_FUSION = True
LAUNCH = {"enable_fp_fusion": FP_FUSION}
# What the wrappers guarantee of every tensor a kernel reads (copying otherwise): a 16-byte
# aligned base and strides, the innermost stride 1. ``VEC`` = 16 bytes in elements of the input.
ALIGN_BYTES = 16
# Every integer argument (size, stride, flag) is a 64-bit integer whatever its value: Triton types an
# unannotated int by its value (i32, or i64 past 2**31), so an LM head's batch stride at 64k tokens x
# 152k vocab would compile a second variant no test ever compiled.
I64 = tl.int64
# Sizes, counts and flags bounded far below 2**31 (a sequence, a head count, a page): 32-bit always.
I32 = tl.int32


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
    M: I32, N: I32, K: I32,
    stride_ab: I64, stride_am: I64,
    stride_bb: I64, stride_bn: I64,
    stride_cb: I64, stride_cm: I64,
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
def row_sum_kernel(x_ptr, out_ptr, N: I32, stride_row: I64, BLOCK: tl.constexpr, VEC: tl.constexpr):
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
def softmax_kernel(x_ptr, out_ptr, N: I32, stride_x: I64, stride_out: I64, BLOCK: tl.constexpr, VEC: tl.constexpr):
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
def in_elements(s0, s1, s2, VEC: tl.constexpr):
    """Three strides given in 16-byte units (``VEC`` elements) as element strides: the multiplication
    by a constant is how a kernel knows their alignment from its code, never from a specialisation."""
    return s0 * VEC, s1 * VEC, s2 * VEC


@triton.jit
def operand(x, like, INTERPRETED: tl.constexpr):
    """fp32 ``x`` as the second product's operand in ``like``'s dtype: rounded to nearest even to
    bf16 / fp16 (a tensor-core operand), fp32 unchanged. Under the interpreter (whose bf16 cast
    truncates) the rounding is done on the bits and the value stays fp32 (``tile_dot`` upcasts)."""
    if like.dtype == tl.float32:
        return x
    if INTERPRETED and like.dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(like.dtype)


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
            do_not_specialize_on_alignment=["pos_ptr", "seqlen_ptr", "table_ptr", "lse_ptr"])
def attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, pos_ptr, seqlen_ptr, table_ptr,
    sq: I32, hq: I32, group: I32, scale, block: I32, per_split: I32, page_size: I32, causal: I32,
    s_qb: I64, s_qh: I64, s_qs: I64,
    s_kp: I64, s_ko: I64, s_kh: I64,
    s_vp: I64, s_vo: I64, s_vh: I64,
    s_ob: I64, s_oh: I64, s_os: I64,
    s_pb: I64, s_tb: I64,
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
    probabilities by ``pairwise_row_sum`` of the fp32 P, P @ V with P rounded to the input dtype)
    depends only on its own position and the keys, so a block past its last visible key is an exact
    no-op (rescale exp(0) = 1, zero probabilities) and a tile may stop at its last query's block.
    With SPLIT, every ``per_split`` blocks form a split with its own state, merged into the running
    total in split order. Each query's log-sum-exp of its scaled scores goes to ``lse`` (b, hq, sq)
    in fp32 (+inf for a query that sees no key): the backward's probabilities.

    q/k/v/o: unit stride in the head dim, 16-byte aligned bases and strides; positions and the page
    table: unit stride along a row (the wrapper's guarantees).
    """
    s_qb, s_qh, s_qs = in_elements(s_qb, s_qh, s_qs, VEC)
    s_kp, s_ko, s_kh = in_elements(s_kp, s_ko, s_kh, VEC)
    s_vp, s_vo, s_vh = in_elements(s_vp, s_vo, s_vh, VEC)
    s_ob, s_oh, s_os = in_elements(s_ob, s_oh, s_os, O_VEC)
    pid_q = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // hq
    h = bh % hq
    hk = h // group
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < sq
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qs + dims[None, :],
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
        offset = kpos % page_size
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
        acc = tile_dot(operand(p, vt, INTERPRETED), vt, acc * alpha[:, None], INTERPRETED)
        m = m_new
    if SPLIT:
        m, l, acc = _merge_state(m_t, l_t, acc_t, m, l, acc)
    out = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1.1754943508222875e-38)[:, None], 0.0)
    tl.store(o_ptr + b * s_ob + h * s_oh + rows[:, None] * s_os + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = tl.where(l > 0, m + tl.log(tl.maximum(l, 1.1754943508222875e-38)), float("inf"))
    tl.store(lse_ptr + bh * sq + rows, lse, mask=row_ok)


# The backward: three kernels over training's layout (q, o, dO (b, hq, sq, d); k, v (b, hkv, sk, d);
# positions (b, sq); keys per entry (b,)), the probabilities recomputed from q, k and the forward's
# log-sum-exp. No atomics: dK / dV of a key block are one program's (every query head of its group,
# every query block, in order), dQ of a query block another's (every key block in order), so a
# head's gradients depend on its own rows only, never on the batch or the TP split. Products on
# tensor cores in bf16 / fp16 with the fp32 P and dS rounded to the input dtype (as FlashAttention's
# backward), IEEE fp32 otherwise; gradients written in fp32 (the wrapper casts).
_BWD_INTS = ["sq", "hq", "group", "causal", "s_qb", "s_qh", "s_qs", "s_kb", "s_kh", "s_ks", "s_vb", "s_vh", "s_vs",
             "s_gb", "s_gh", "s_gs", "s_pb"]


@triton.jit(do_not_specialize=["sq", "hq", "s_ob", "s_oh", "s_os", "s_gb", "s_gh", "s_gs"],
            do_not_specialize_on_alignment=["delta_ptr"])
def attention_delta_kernel(o_ptr, do_ptr, delta_ptr, sq: I32, hq: I32, s_ob: I64, s_oh: I64, s_os: I64, s_gb: I64,
                           s_gh: I64, s_gs: I64, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                           VEC: tl.constexpr):
    """delta[b, h, row] = sum over the head dim of O * dO in fp32, in ``pairwise_row_sum``'s tree
    (O and dO both in q's dtype: one VEC)."""
    s_ob, s_oh, s_os = in_elements(s_ob, s_oh, s_os, VEC)
    s_gb, s_gh, s_gs = in_elements(s_gb, s_gh, s_gs, VEC)
    pid_q = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // hq
    h = bh % hq
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    ok = (rows < sq)[:, None] & (dims < D)[None, :]
    o = tl.load(o_ptr + b * s_ob + h * s_oh + rows[:, None] * s_os + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b * s_gb + h * s_gh + rows[:, None] * s_gs + dims[None, :], mask=ok,
                 other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh * sq + rows, pairwise_row_sum(o * do), mask=rows < sq)


@triton.jit
def _probabilities(scores, lse, visible):
    """exp(score - lse) where visible, 0 elsewhere (lse +inf for a query that sees no key: 0)."""
    return tl.where(visible, tl.exp(scores - lse), 0.0)


@triton.jit(do_not_specialize=_BWD_INTS + ["sk"],
            do_not_specialize_on_alignment=["lse_ptr", "delta_ptr", "pos_ptr", "seqlen_ptr", "dk_ptr", "dv_ptr"])
def attention_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, pos_ptr, seqlen_ptr, dk_ptr, dv_ptr,
    sq: I32, sk: I32, hq: I32, group: I32, scale, causal: I32,
    s_qb: I64, s_qh: I64, s_qs: I64, s_kb: I64, s_kh: I64, s_ks: I64, s_vb: I64, s_vh: I64, s_vs: I64,
    s_gb: I64, s_gh: I64, s_gs: I64, s_pb: I64,
    D: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    BLOCK_D: tl.constexpr, VEC: tl.constexpr,
):
    """dK and dV of BLOCK_KEYS keys of one (batch, kv head): the group's query heads in order, each
    over its query blocks in order (a block whose queries all precede the keys adds exactly 0 and is
    skipped). Transposed products (keys x queries), so P^T and dS^T are computed, not transposed.
    dO has q's dtype and strides' alignment; dk / dv: fp32 (b, hkv, sk, D), contiguous."""
    s_qb, s_qh, s_qs = in_elements(s_qb, s_qh, s_qs, VEC)
    s_kb, s_kh, s_ks = in_elements(s_kb, s_kh, s_ks, VEC)
    s_vb, s_vh, s_vs = in_elements(s_vb, s_vh, s_vs, VEC)
    s_gb, s_gh, s_gs = in_elements(s_gb, s_gh, s_gs, VEC)
    pid_k = tl.program_id(0)
    bhk = tl.program_id(1).to(tl.int64)
    hkv = hq // group
    b = bhk // hkv
    hk = bhk % hkv
    keys = pid_k * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    n_keys = tl.load(seqlen_ptr + b)
    key_ok = keys < n_keys
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    kv_ok = key_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + b * s_kb + hk * s_kh + keys[:, None] * s_ks + dims[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_ptr + b * s_vb + hk * s_vh + keys[:, None] * s_vs + dims[None, :], mask=kv_ok, other=0.0)
    dk = tl.zeros((BLOCK_KEYS, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_KEYS, BLOCK_D), dtype=tl.float32)
    first_key = pid_k * BLOCK_KEYS
    lanes = tl.arange(0, BLOCK_Q)
    for hh in range(0, group):
        h = hk * group + hh
        for start in range(0, sq, BLOCK_Q):
            rows = start + lanes
            row_ok = rows < sq
            pos = tl.load(pos_ptr + b * s_pb + rows, mask=row_ok, other=-1)
            if (causal == 0) | (tl.max(pos, axis=0) >= first_key):
                q_ok = row_ok[:, None] & d_ok[None, :]
                q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qs + dims[None, :], mask=q_ok,
                            other=0.0)
                do = tl.load(do_ptr + b * s_gb + h * s_gh + rows[:, None] * s_gs + dims[None, :], mask=q_ok,
                             other=0.0)
                lse = tl.load(lse_ptr + (b * hq + h) * sq + rows, mask=row_ok, other=float("inf"))
                delta = tl.load(delta_ptr + (b * hq + h) * sq + rows, mask=row_ok, other=0.0)
                visible = key_ok[:, None] & row_ok[None, :] & ((keys[:, None] <= pos[None, :]) | (causal == 0))
                st = tile_dot(k, tl.trans(q), tl.zeros((BLOCK_KEYS, BLOCK_Q), dtype=tl.float32), INTERPRETED)
                pt = _probabilities(st * scale, lse[None, :], visible)
                dv = tile_dot(operand(pt, k, INTERPRETED), do, dv, INTERPRETED)
                dpt = tile_dot(v, tl.trans(do), tl.zeros((BLOCK_KEYS, BLOCK_Q), dtype=tl.float32), INTERPRETED)
                dst = pt * (dpt - delta[None, :])
                dk = tile_dot(operand(dst, k, INTERPRETED), q, dk, INTERPRETED)
    out = (bhk * sk + keys[:, None]) * D + dims[None, :]
    tl.store(dk_ptr + out, dk * scale, mask=kv_ok)
    tl.store(dv_ptr + out, dv, mask=kv_ok)


@triton.jit(do_not_specialize=_BWD_INTS, do_not_specialize_on_alignment=["lse_ptr", "delta_ptr", "pos_ptr",
                                                                         "seqlen_ptr", "dq_ptr"])
def attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, pos_ptr, seqlen_ptr, dq_ptr,
    sq: I32, hq: I32, group: I32, scale, causal: I32,
    s_qb: I64, s_qh: I64, s_qs: I64, s_kb: I64, s_kh: I64, s_ks: I64, s_vb: I64, s_vh: I64, s_vs: I64,
    s_gb: I64, s_gh: I64, s_gs: I64, s_pb: I64,
    D: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    BLOCK_D: tl.constexpr, VEC: tl.constexpr,
):
    """dQ of BLOCK_Q queries of one (batch, head): its key blocks in order, up to the last one a
    query of the tile sees (causal). dq: fp32 (b, hq, sq, D), contiguous."""
    s_qb, s_qh, s_qs = in_elements(s_qb, s_qh, s_qs, VEC)
    s_kb, s_kh, s_ks = in_elements(s_kb, s_kh, s_ks, VEC)
    s_vb, s_vh, s_vs = in_elements(s_vb, s_vh, s_vs, VEC)
    s_gb, s_gh, s_gs = in_elements(s_gb, s_gh, s_gs, VEC)
    pid_q = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // hq
    h = bh % hq
    hk = h // group
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < sq
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    q_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qs + dims[None, :], mask=q_ok, other=0.0)
    do = tl.load(do_ptr + b * s_gb + h * s_gh + rows[:, None] * s_gs + dims[None, :], mask=q_ok, other=0.0)
    lse = tl.load(lse_ptr + bh * sq + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + bh * sq + rows, mask=row_ok, other=0.0)
    pos = tl.load(pos_ptr + b * s_pb + rows, mask=row_ok, other=-1)
    n_keys = tl.load(seqlen_ptr + b)
    stop = n_keys
    if causal != 0:
        stop = tl.minimum(stop, tl.max(pos, axis=0) + 1)
    lanes = tl.arange(0, BLOCK_KEYS)
    dq = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for first in range(0, stop, BLOCK_KEYS):
        keys = first + lanes
        key_ok = keys < n_keys
        kv_ok = d_ok[:, None] & key_ok[None, :]
        kt = tl.load(k_ptr + b * s_kb + hk * s_kh + keys[None, :] * s_ks + dims[:, None], mask=kv_ok, other=0.0)
        vt = tl.load(v_ptr + b * s_vb + hk * s_vh + keys[None, :] * s_vs + dims[:, None], mask=kv_ok, other=0.0)
        visible = key_ok[None, :] & row_ok[:, None] & ((keys[None, :] <= pos[:, None]) | (causal == 0))
        s = tile_dot(q, kt, tl.zeros((BLOCK_Q, BLOCK_KEYS), dtype=tl.float32), INTERPRETED)
        p = _probabilities(s * scale, lse[:, None], visible)
        dp = tile_dot(do, vt, tl.zeros((BLOCK_Q, BLOCK_KEYS), dtype=tl.float32), INTERPRETED)
        ds = p * (dp - delta[:, None])
        dq = tile_dot(operand(ds, q, INTERPRETED), tl.trans(kt), dq, INTERPRETED)
    tl.store(dq_ptr + (bh * sq + rows[:, None]) * D + dims[None, :], dq * scale, mask=q_ok)
