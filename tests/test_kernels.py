"""Torch reference kernels, single process.

Bitwise claims use ``torch.equal`` on raw tensors. Tolerances appear only in semantics checks
against a plain-torch reference, and each such place says so.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed_tp.errors import ConfigError
from conftest import bits_equal
from mindspeed_tp.kernels import (
    apply_rope,
    consistent_attention,
    folded_leaf_partials,
    invariant_linear,
    layer_norm,
    leaf_partials,
    rms_norm,
    rope_angles,
    rope_inv_freq,
    tree_fold,
    vocab_parallel_logprob,
)

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


# --------------------------------------------------------------------------- invariant_linear


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k,n", [(129, 77), (64, 96)])
def test_invariant_linear_batch_invariant(dtype, k, n):
    x = _randn(64, k, seed=1, dtype=dtype)
    w = _randn(n, k, seed=2, dtype=dtype)
    full = invariant_linear(x, w)
    assert full.dtype == dtype and full.shape == (64, n)
    bad = [m for m in range(1, 65) if not bits_equal(invariant_linear(x[:m], w), full[:m])]
    assert bad == [], f"rows differ from the M=64 result for M in {bad}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k,n", [(129, 77), (64, 96)])
def test_invariant_linear_batch_invariant_with_bias_and_lead_dims(dtype, k, n):
    x = _randn(4, 16, k, seed=3, dtype=dtype)
    w = _randn(n, k, seed=4, dtype=dtype)
    b = _randn(n, seed=5, dtype=dtype)
    full = invariant_linear(x, w, b)
    assert full.shape == (4, 16, n)
    for i in range(4):
        for m in (1, 7, 16):
            assert bits_equal(invariant_linear(x[i, :m], w, b), full[i, :m])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k,n", [(129, 77), (64, 96)])
@pytest.mark.parametrize("shards", [2, 4])
def test_invariant_linear_shard_invariant(dtype, k, n, shards):
    x = _randn(37, k, seed=6, dtype=dtype)
    w = _randn(n, k, seed=7, dtype=dtype)
    full = invariant_linear(x, w)
    start = 0
    # tensor_split: uneven shards when N is odd (77 -> 39+38, 20+19+19+19).
    for ws in w.tensor_split(shards, dim=0):
        stop = start + ws.shape[0]
        assert bits_equal(invariant_linear(x, ws), full[:, start:stop]), (start, stop)
        start = stop
    assert start == n


def test_plain_matmul_is_not_batch_invariant():
    """Proves the row padding matters: the BLAS result of x @ w.T depends on M here."""
    x = _randn(64, 129, seed=8)
    w = _randn(77, 129, seed=9)
    full = x @ w.t()
    differing = [m for m in range(1, 65) if not bits_equal(x[:m] @ w.t(), full[:m])]
    assert len(differing) >= 1
    # and the invariant kernel is exact for the very same M values
    inv_full = invariant_linear(x, w)
    for m in differing:
        assert bits_equal(invariant_linear(x[:m], w), inv_full[:m])


# --------------------------------------------------------------------------- tree_fold


def test_tree_fold_explicit_order():
    t = _randn(4, 33, seed=10, scale=1e3) + _randn(4, 33, seed=11, scale=1e-3)
    a, b, c, d = t
    assert bits_equal(tree_fold(t, dim=0), (a + b) + (c + d))
    t8 = _randn(8, 5, 7, seed=12, scale=100.0)
    l = list(t8)
    expected = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    assert bits_equal(tree_fold(t8, dim=0), expected)
    # a non-leading dim
    assert bits_equal(tree_fold(t8.movedim(0, 2), dim=2), expected)
    assert bits_equal(tree_fold(t8.movedim(0, -1), dim=-1), expected)


def test_tree_fold_differs_from_sequential_sum_somewhere():
    # The order is observable: for some inputs ((a+b)+(c+d)) != ((a+b)+c)+d in fp32.
    t = torch.tensor([[1.0], [1e8], [-1e8], [1.0]]).expand(4, 1).contiguous()
    seq = ((t[0] + t[1]) + t[2]) + t[3]
    assert not bits_equal(tree_fold(t, dim=0), seq)
    assert bits_equal(tree_fold(t, dim=0), (t[0] + t[1]) + (t[2] + t[3]))


def test_tree_fold_single_leaf():
    t = _randn(1, 9, seed=13)
    assert bits_equal(tree_fold(t, dim=0), t[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tree_fold_decomposes_by_rank(dtype):
    t = (_randn(8, 3, 50, seed=14, scale=1e4) * _randn(8, 3, 50, seed=15).exp()).to(dtype)
    full = tree_fold(t, dim=0)
    halves = tree_fold(t[:4], 0) + tree_fold(t[4:], 0)
    assert bits_equal(full, halves)
    quarters = [tree_fold(t[2 * i: 2 * i + 2], 0) for i in range(4)]
    assert bits_equal(full, (quarters[0] + quarters[1]) + (quarters[2] + quarters[3]))
    assert bits_equal(full, tree_fold(torch.stack(quarters), 0))
    assert bits_equal(full, tree_fold(torch.stack([tree_fold(t[:4], 0), tree_fold(t[4:], 0)]), 0))


@pytest.mark.parametrize("n", [0, 3, 5, 6, 12])
def test_tree_fold_rejects_non_power_of_two(n):
    with pytest.raises(ValueError):
        tree_fold(torch.ones(n, 4), dim=0)


# --------------------------------------------------------------------------- leaf partials


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,k,n", [(5, 256, 48), (33, 512, 77)])
@pytest.mark.parametrize("tp", [2, 4])
def test_leaf_partials_tp_split_is_bitwise(dtype, m, k, n, tp):
    c = 8
    x = _randn(m, k, seed=16, dtype=dtype)
    w = _randn(n, k, seed=17, dtype=dtype)
    ref_leaves = leaf_partials(x, w, c)
    assert ref_leaves.shape == (c, m, n) and ref_leaves.dtype == torch.float32
    ref = folded_leaf_partials(x, w, c)
    assert bits_equal(ref, tree_fold(ref_leaves, 0))
    xs, ws = x.chunk(tp, dim=-1), w.chunk(tp, dim=-1)
    # each rank computes C/TP leaves of its contiguous K shard: the very same leaves
    local_leaves = [leaf_partials(xr, wr, c // tp) for xr, wr in zip(xs, ws)]
    assert bits_equal(torch.cat(local_leaves, 0), ref_leaves)
    # each rank folds its subtree, the subtrees are folded across ranks in rank order
    subtrees = [folded_leaf_partials(xr, wr, c // tp) for xr, wr in zip(xs, ws)]
    assert bits_equal(tree_fold(torch.stack(subtrees), 0), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("leaves", [1, 2, 4, 8, 16])
def test_progressive_fold_is_the_tree(dtype, leaves):
    """folded_leaf_partials folds pairs of leaves as they are computed: the same additions as
    tree_fold over all leaves at once."""
    x = _randn(21, 32 * leaves, seed=22, dtype=dtype)
    w = _randn(19, 32 * leaves, seed=23, dtype=dtype)
    assert bits_equal(folded_leaf_partials(x, w, leaves), tree_fold(leaf_partials(x, w, leaves), 0))


def test_leaf_partials_semantics():
    # Semantics check vs a plain fp64 product (tolerance): the tree sum is x @ w.T.
    x = _randn(9, 256, seed=18)
    w = _randn(40, 256, seed=19)
    out = folded_leaf_partials(x, w, 8)
    torch.testing.assert_close(out, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4)


def test_leaf_partials_batch_invariant():
    x = _randn(40, 128, seed=20)
    w = _randn(24, 128, seed=21)
    full = folded_leaf_partials(x, w, 8)
    for m in (1, 3, 17, 39):
        assert bits_equal(folded_leaf_partials(x[:m], w, 8), full[:m])


def test_leaf_partials_rejects_indivisible_k():
    with pytest.raises(ValueError):
        leaf_partials(torch.ones(2, 100), torch.ones(3, 100), 8)


# --------------------------------------------------------------------------- attention


def _ref_attention(q, k, v, scale, causal=True, q_positions=None, excluded=None):
    """Straightforward softmax attention in fp64 (GQA by repeat_interleave); rows with no
    visible key give 0, as the kernel defines."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if q_positions is None:
        q_positions = torch.arange(sk - sq, sk)
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible = torch.arange(sk)[None, :] <= q_positions[:, None]
    visible = visible.expand(b, 1, sq, sk)
    if excluded is not None:
        visible = visible & ~excluded
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vv).float()


B, HQ, HKV, S, D = 2, 8, 2, 300, 16
SCALE = 1.0 / math.sqrt(D)


def _qkv(dtype, seed=30, s=S):
    q = _randn(B, HQ, s, D, seed=seed, dtype=dtype)
    k = _randn(B, HKV, s, D, seed=seed + 1, dtype=dtype)
    v = _randn(B, HKV, s, D, seed=seed + 2, dtype=dtype)
    return q, k, v


def _padding_mask(s=S, pad=7):
    # batch row 1 is left-padded: its first ``pad`` keys are excluded for every query.
    ex = torch.zeros(B, 1, s, s, dtype=torch.bool)
    ex[1, :, :, :pad] = True
    return ex


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
def test_attention_semantics(block_size, causal, masked):
    # Semantics check against a plain fp64 softmax attention: tolerance, not bits.
    q, k, v = _qkv(torch.float32, s=150)
    ex = _padding_mask(150) if masked else None
    out = consistent_attention(q, k, v, SCALE, causal=causal, excluded=ex, block_size=block_size)
    assert out.shape == (B, HQ, 150, D) and out.dtype == torch.float32
    ref = _ref_attention(q, k, v, SCALE, causal=causal, excluded=ex)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if masked and causal:
        # queries that see only padding keys output exactly zero
        assert bits_equal(out[1, :, :7], torch.zeros_like(out[1, :, :7]))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
def test_attention_gradient_and_forward_under_grad(masked, causal):
    """With autograd on, the forward is still the blocked kernel's bits, and the gradient (exact
    attention's, recomputed in backward) matches fp64 attention's (semantics: tolerance); queries
    that see only padding get zero gradient, not NaN."""
    q, k, v = _qkv(torch.float32, s=150)
    ex = _padding_mask(150) if masked else None
    with torch.no_grad():
        plain = consistent_attention(q, k, v, SCALE, causal=causal, excluded=ex, block_size=16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = consistent_attention(*leaves, SCALE, causal=causal, excluded=ex, block_size=16)
    assert bits_equal(out.detach(), plain)
    upstream = _randn(*out.shape, seed=33)
    (out * upstream).sum().backward()
    refs = [t.double().clone().requires_grad_() for t in (q, k, v)]
    (_ref_attention(*refs, SCALE, causal=causal, excluded=ex).double() * upstream.double()).sum().backward()
    for mine, ref in zip(leaves, refs):
        assert torch.isfinite(mine.grad).all()
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def test_attention_semantics_bf16_and_query_suffix():
    # Semantics check (tolerance) in bf16, with q_positions (queries are a suffix of the keys).
    q, k, v = _qkv(torch.bfloat16, s=100)
    pos = torch.arange(60, 100)
    out = consistent_attention(q[:, :, 60:], k, v, SCALE, q_positions=pos, block_size=16)
    assert out.dtype == torch.bfloat16
    ref = _ref_attention(q[:, :, 60:], k, v, SCALE, q_positions=pos)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_with_a_value_head_size_of_its_own(block_size, causal):
    """Multi-latent attention's heads: queries and keys of 24 channels (192 in DeepSeek-V3), values of
    16 (128). The forward is fp64 attention's (tolerance), a query suffix scores its rows bit for bit
    as the full prefill, the padded sequence's empty output has the value size, and the recomputed
    gradient is fp64 attention's."""
    q = _randn(B, HQ, 150, 24, seed=40)
    k = _randn(B, HKV, 150, 24, seed=41)
    v = _randn(B, HKV, 150, 16, seed=42)
    ex = _padding_mask(150)
    out = consistent_attention(q, k, v, SCALE, causal=causal, excluded=ex, block_size=block_size)
    assert out.shape == (B, HQ, 150, 16)
    torch.testing.assert_close(out, _ref_attention(q, k, v, SCALE, causal=causal, excluded=ex), rtol=1e-5, atol=1e-5)
    if causal:
        pos = torch.arange(100, 150)
        suffix = consistent_attention(q[:, :, 100:], k, v, SCALE, q_positions=pos, excluded=ex[..., 100:, :],
                                      block_size=block_size)
        assert bits_equal(suffix, out[:, :, 100:])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = consistent_attention(*leaves, SCALE, causal=causal, excluded=ex, block_size=block_size)
    assert bits_equal(got.detach(), out)
    upstream = _randn(*out.shape, seed=43)
    (got * upstream).sum().backward()
    refs = [t.double().clone().requires_grad_() for t in (q, k, v)]
    (_ref_attention(*refs, SCALE, causal=causal, excluded=ex).double() * upstream.double()).sum().backward()
    for mine, ref in zip(leaves, refs):
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def test_packed_attention_with_no_sequence_keeps_the_value_head_size():
    from mindspeed_tp.kernels.attention import packed_attention

    q, k, v = torch.zeros(0, HQ, 24), torch.zeros(0, HKV, 24), torch.zeros(0, HKV, 16)
    out = packed_attention(q, k, v, torch.tensor([0, 0]), scale=SCALE, causal=True)
    assert out.shape == (0, HQ, 16)


def test_attention_rejects_bad_gqa():
    q = torch.zeros(1, 3, 4, 8)
    k = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError):
        consistent_attention(q, k, k, 1.0)


CHUNKS = [(0, 1), (0, 37), (37, 128), (128, 129), (129, 256), (250, 300), (17, 300)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
def test_attention_chunked_prefill_bitwise(dtype, block_size, masked):
    q, k, v = _qkv(dtype)
    ex = _padding_mask() if masked else None
    full = consistent_attention(q, k, v, SCALE, causal=True, excluded=ex, block_size=block_size)
    for lo, hi in CHUNKS:
        chunk_ex = ex[:, :, lo:hi, :hi] if masked else None
        explicit = consistent_attention(
            q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], SCALE, causal=True,
            q_positions=torch.arange(lo, hi), excluded=chunk_ex, block_size=block_size,
        )
        assert bits_equal(explicit, full[:, :, lo:hi]), (lo, hi)
        # default q_positions: the last sq key positions -- the same thing
        default = consistent_attention(
            q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], SCALE, causal=True,
            excluded=chunk_ex, block_size=block_size,
        )
        assert bits_equal(default, full[:, :, lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 128])
def test_attention_decode_bitwise(dtype, block_size):
    q, k, v = _qkv(dtype, s=160)
    ex = _padding_mask(160)
    full = consistent_attention(q, k, v, SCALE, causal=True, excluded=ex, block_size=block_size)
    for pos in (0, 1, 6, 7, 15, 16, 17, 100, 127, 128, 129, 159):
        step = consistent_attention(
            q[:, :, pos:pos + 1], k[:, :, :pos + 1], v[:, :, :pos + 1], SCALE, causal=True,
            q_positions=torch.tensor([pos]), excluded=ex[:, :, pos:pos + 1, :pos + 1],
            block_size=block_size,
        )
        assert bits_equal(step, full[:, :, pos:pos + 1]), pos


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 128])
def test_attention_independent_of_heads_and_batch_computed_together(dtype, block_size):
    q, k, v = _qkv(dtype, s=140)
    ex = _padding_mask(140)
    full = consistent_attention(q, k, v, SCALE, excluded=ex, block_size=block_size)
    g = HQ // HKV
    # one batch row alone
    for bi in range(B):
        one = consistent_attention(q[bi:bi + 1], k[bi:bi + 1], v[bi:bi + 1], SCALE,
                                   excluded=ex[bi:bi + 1], block_size=block_size)
        assert bits_equal(one, full[bi:bi + 1])
    # one kv group (a TP rank holding one kv head and its g query heads)
    for kv in range(HKV):
        grp = consistent_attention(q[:, kv * g:(kv + 1) * g], k[:, kv:kv + 1], v[:, kv:kv + 1],
                                   SCALE, excluded=ex, block_size=block_size)
        assert bits_equal(grp, full[:, kv * g:(kv + 1) * g])
    # a single query head of a single batch row
    for bi, h in ((0, 0), (1, 5), (1, 7)):
        kv = h // g
        single = consistent_attention(q[bi:bi + 1, h:h + 1], k[bi:bi + 1, kv:kv + 1],
                                      v[bi:bi + 1, kv:kv + 1], SCALE, excluded=ex[bi:bi + 1],
                                      block_size=block_size)
        assert bits_equal(single, full[bi:bi + 1, h:h + 1])


# --------------------------------------------------------------------------- norms


@pytest.mark.parametrize("h", [64, 77])
def test_norms_semantics_fp32(h):
    # Semantics check against torch.nn.functional (tolerance).
    x = _randn(37, h, seed=40, scale=3.0) + 1.0
    w = _randn(h, seed=41)
    b = _randn(h, seed=42)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (h,), w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rms_norm(x, None, 1e-6), F.rms_norm(x, (h,), None, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        layer_norm(x, w, b, 1e-5), F.layer_norm(x, (h,), w, b, 1e-5), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        layer_norm(x, None, None, 1e-5), F.layer_norm(x, (h,), None, None, 1e-5), rtol=1e-5, atol=1e-5
    )


def test_norms_bf16_dtype_preserved():
    x = _randn(5, 3, 64, seed=43, dtype=torch.bfloat16)
    w = _randn(64, seed=44, dtype=torch.bfloat16)
    b = _randn(64, seed=45, dtype=torch.bfloat16)
    r = rms_norm(x, w, 1e-6)
    l = layer_norm(x, w, b, 1e-5)
    assert r.dtype == torch.bfloat16 and r.shape == x.shape
    assert l.dtype == torch.bfloat16 and l.shape == x.shape
    # Semantics check (tolerance): one cast of the fp32 result.
    torch.testing.assert_close(r, rms_norm(x.float(), w.float(), 1e-6).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(
        r.float(), F.rms_norm(x.float(), (64,), w.float(), 1e-6), rtol=1e-2, atol=1e-2
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("h", [64, 77, 1024])
def test_norms_row_invariant(dtype, h):
    x = _randn(37, h, seed=46, dtype=dtype, scale=2.0)
    w = _randn(h, seed=47, dtype=dtype)
    b = _randn(h, seed=48, dtype=dtype)
    r = rms_norm(x, w, 1e-6)
    l = layer_norm(x, w, b, 1e-5)
    for i in range(37):
        assert bits_equal(rms_norm(x[i:i + 1], w, 1e-6), r[i:i + 1]), i
        assert bits_equal(rms_norm(x[i], w, 1e-6), r[i]), i
        assert bits_equal(layer_norm(x[i:i + 1], w, b, 1e-5), l[i:i + 1]), i
    # in a bigger / 3-D batch too
    big = torch.cat([x, x[:5]]).reshape(6, 7, h)
    assert bits_equal(rms_norm(big, w, 1e-6).reshape(42, h)[:37], r)
    assert bits_equal(layer_norm(big, w, b, 1e-5).reshape(42, h)[:37], l)


# --------------------------------------------------------------------------- rope


def _naive_rope(t, positions, base, rot, interleaved):
    """Per pair rotation in fp64 from math.cos/math.sin, angle = p * base**(-2i/rot)."""
    out = t.double().clone()
    src = t.double()
    for si, p in enumerate(positions.tolist()):
        for i in range(rot // 2):
            theta = p * base ** (-2.0 * i / rot)
            c, s = math.cos(theta), math.sin(theta)
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rot // 2)
            xa, xb = src[si, ..., a], src[si, ..., b]
            out[si, ..., a] = xa * c - xb * s
            out[si, ..., b] = xb * c + xa * s
    return out


def test_rope_angles_semantics():
    # Semantics check (tolerance) vs fp64 angles.
    inv = rope_inv_freq(16, 10000.0)
    ref_inv = torch.tensor([10000.0 ** (-2.0 * i / 16) for i in range(8)], dtype=torch.float64)
    torch.testing.assert_close(inv.double(), ref_inv, rtol=1e-6, atol=0)
    pos = torch.arange(0, 50)
    ang = rope_angles(pos, inv)
    assert ang.shape == (50, 16) and ang.dtype == torch.float32
    ref = torch.outer(pos.double(), ref_inv)
    torch.testing.assert_close(ang.double(), torch.cat([ref, ref], -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rot,d", [(16, 16), (8, 16)])
def test_apply_rope_semantics(dtype, interleaved, rot, d):
    # Semantics check against a naive per-pair reference (tolerance).
    s, b, h = 40, 2, 3
    base = 10000.0
    t = _randn(s, b, h, d, seed=50, dtype=dtype)
    positions = torch.arange(s) + 5
    inv = rope_inv_freq(rot, base)
    ang = rope_angles(positions, inv)  # (s, rot), [freqs, freqs]
    if interleaved:
        freqs = ang[:, : rot // 2]
        ang = torch.stack([freqs, freqs], dim=-1).reshape(s, rot)  # [f0, f0, f1, f1, ...]
    out = apply_rope(t, ang[:, None, None, :], interleaved=interleaved)
    assert out.dtype == dtype and out.shape == t.shape
    ref = _naive_rope(t, positions, base, rot, interleaved)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # the channels beyond ``rot`` pass through untouched (bits)
    assert bits_equal(out[..., rot:], t[..., rot:])


def test_apply_rope_position_invariant_across_chunks():
    # a token's rotation depends only on its absolute position, not the chunk (bits)
    t = _randn(64, 1, 2, 16, seed=51, dtype=torch.bfloat16)
    inv = rope_inv_freq(16, 10000.0)
    full = apply_rope(t, rope_angles(torch.arange(64), inv)[:, None, None, :])
    part = apply_rope(t[30:41], rope_angles(torch.arange(30, 41), inv)[:, None, None, :])
    assert bits_equal(part, full[30:41])


# --------------------------------------------------------------------------- logprob


def _ref_logprob(logits, target, temperature):
    return torch.log_softmax(logits.double() / temperature, dim=-1).gather(-1, target[..., None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_semantics(temperature):
    # Semantics check against torch.log_softmax (tolerance).
    logits = _randn(3, 5, 1024, seed=60, scale=4.0)
    target = torch.randint(0, 1024, (3, 5), generator=_gen(61))
    out = vocab_parallel_logprob(logits, target, None, canonical_shards=8, temperature=temperature)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    ref = torch.log_softmax(logits.float() / temperature, -1).gather(-1, target[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), _ref_logprob(logits, target, temperature), rtol=1e-5, atol=1e-5)


def test_logprob_semantics_bf16_logits():
    # Semantics check (tolerance): bf16 logits are upcast, the result is fp32.
    logits = _randn(4, 512, seed=62, scale=3.0, dtype=torch.bfloat16)
    target = torch.randint(0, 512, (4,), generator=_gen(63))
    out = vocab_parallel_logprob(logits, target, None, canonical_shards=8)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _ref_logprob(logits.float(), target, 1.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_padding_columns_excluded(temperature):
    vocab, padded = 1000, 1024
    logits = _randn(3, 5, padded, seed=64, scale=4.0)
    target = torch.randint(0, vocab, (3, 5), generator=_gen(65))
    padded_out = vocab_parallel_logprob(logits, target, None, 8, vocab_size=vocab, temperature=temperature)
    truncated = vocab_parallel_logprob(
        logits[..., :vocab].contiguous(), target, None, 8, vocab_size=None, temperature=temperature
    )
    # The leaves follow the true vocab, not the padding: padded and unpadded give the same bits.
    assert bits_equal(padded_out, truncated)
    torch.testing.assert_close(padded_out.double(), _ref_logprob(logits[..., :vocab], target, temperature),
                               rtol=1e-5, atol=1e-5)
    # the padded columns' values do not matter at all (bits), even huge ones
    for fill in (1e4, -1e4, 0.0, float("inf")):
        other = logits.clone()
        other[..., vocab:] = fill
        assert bits_equal(
            vocab_parallel_logprob(other, target, None, 8, vocab_size=vocab, temperature=temperature),
            padded_out,
        ), fill
    # and without vocab_size they would have mattered
    huge = logits.clone()
    huge[..., vocab:] = 1e4
    unmasked = vocab_parallel_logprob(huge, target, None, 8, vocab_size=None, temperature=temperature)
    assert not torch.allclose(unmasked, padded_out)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_gradient(temperature):
    logits = _randn(3, 5, 1024, seed=66, scale=4.0)
    target = torch.randint(0, 1024, (3, 5), generator=_gen(67))
    upstream = _randn(3, 5, seed=68)
    x = logits.clone().requires_grad_()
    y = logits.clone().requires_grad_()
    (vocab_parallel_logprob(x, target, None, 8, temperature=temperature) * upstream).sum().backward()
    ref = torch.log_softmax(y / temperature, -1).gather(-1, target[..., None]).squeeze(-1)
    (ref * upstream).sum().backward()
    # Semantics check against autograd of torch.log_softmax (tolerance).
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)


def test_logprob_gradient_padded_and_bf16():
    vocab, padded = 1000, 1024
    logits = _randn(4, padded, seed=69, scale=3.0, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (4,), generator=_gen(70))
    x = logits.clone().requires_grad_()
    vocab_parallel_logprob(x, target, None, 8, vocab_size=vocab).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert bits_equal(x.grad[:, vocab:].float().abs(), torch.zeros(4, padded - vocab))
    y = logits[:, :vocab].float().clone().requires_grad_()
    torch.log_softmax(y, -1).gather(-1, target[:, None]).sum().backward()
    # Semantics check (tolerance, bf16 gradient).
    torch.testing.assert_close(x.grad[:, :vocab].float(), y.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("chunk", [1, 3 * 5 * 1024, 1 << 24], ids=["row", "three-rows", "whole"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_exponentials_in_runs_of_rows_are_the_whole_tensors_bits(monkeypatch, chunk, temperature):
    """The forward sums exp(logits - max) in runs of rows and the backward recomputes them from the
    saved logits: the logprobs and gradients are the bits of the one-buffer computation (written out
    here: every exponential at once, kept for the backward), for any run length, padded columns too."""
    from mindspeed_tp.kernels import logprob as lp

    vocab, padded = 1000, 1024
    logits = _randn(7, 5, padded, seed=71, scale=4.0)
    target = torch.randint(0, vocab, (7, 5), generator=_gen(72))
    upstream = _randn(7, 5, seed=73)
    lf = logits / temperature if temperature != 1.0 else logits
    lmax = lf[..., :vocab].amax(-1)
    e = torch.sub(lf, lmax.unsqueeze(-1)).exp_()
    e[..., vocab:] = 0.0
    width = lp.vocab_leaf_width(vocab, 8, 128)
    total = lp.tree_fold(lp._leaf_sums(e.reshape(7, 5, padded // width, width)), dim=-1)
    want = (lf.gather(-1, target[..., None]).squeeze(-1) - lmax) - torch.log(total)
    want_grad = -(e / total.unsqueeze(-1)) * upstream.unsqueeze(-1)
    want_grad.scatter_add_(-1, target[..., None], upstream[..., None])
    if temperature != 1.0:
        want_grad = want_grad / temperature
    monkeypatch.setattr(lp, "EXP_CHUNK_ELEMENTS", chunk)
    x = logits.clone().requires_grad_()
    got = vocab_parallel_logprob(x, target, None, 8, vocab_size=vocab, temperature=temperature)
    (got * upstream).sum().backward()
    assert bits_equal(got.detach(), want)
    assert bits_equal(x.grad, want_grad)


def test_logprob_refuses_logits_changed_in_place_before_its_backward():
    """The backward recomputes the exponentials from the caller's fp32 logits (no copy): a caller that
    changes them in place before the backward gets autograd's error, never a gradient of other logits."""
    x = _randn(4, 1024, seed=74).requires_grad_()
    logits = x * 1.0
    out = vocab_parallel_logprob(logits, torch.zeros(4, dtype=torch.long), None, 8)
    with torch.no_grad():
        logits.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("width", [1001, 1020, 12])
def test_logprob_rejects_vocab_not_divisible(width):
    logits = torch.randn(2, width)
    target = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ConfigError, match="leaf width"):
        vocab_parallel_logprob(logits, target, None, canonical_shards=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_invariant_linear_does_not_depend_on_the_thread_count(dtype):
    """Training ranks (torchrun: one thread each) and a single-process rollout may run with other
    thread counts; the GEMM's K order must not follow them."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(77, 640, generator=g).to(dtype)
    w = torch.randn(1024, 640, generator=g).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = invariant_linear(x, w)
        torch.set_num_threads(2)
        two = invariant_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert bits_equal(one, two)


@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_the_torch_backend_is_refused_on_accelerator_tensors(device):
    """Issue #43, item 4: the torch backend's invariance is a CPU BLAS property; on an NPU tensor it was
    accepted (only CUDA was listed)."""
    import types

    from mindspeed_tp import ConfigError
    from mindspeed_tp.kernels import dispatch

    tensor = types.SimpleNamespace(device=types.SimpleNamespace(type=device))
    before = dispatch._selected
    dispatch.select("torch")
    try:
        with pytest.raises(ConfigError, match=f"torch kernel backend is not batch-invariant on {device}"):
            dispatch.backend_name(tensor)
    finally:
        dispatch.select(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window", [0, 5, 23, 130])
def test_sliding_window_attention_is_the_window_mask_and_prefill_decode_agree(dtype, window):
    """A window hides the keys more than ``window`` positions before a query: the same bits as that
    mask given explicitly, close to exact masked attention, and every chunked prefill and one-token
    decode step over the window equals the full pass (the key blocks wholly before a query's window
    add exactly nothing, as causally hidden ones)."""
    from mindspeed_tp.kernels import decode_attention
    from mindspeed_tp.kernels.backends.torch import _math_attention

    q, k, v = (x[:1] for x in _qkv(dtype, s=160))
    pos = torch.arange(160)
    hidden = (pos.view(1, -1) < pos.view(-1, 1) - window).view(1, 1, 160, 160)
    full = consistent_attention(q, k, v, SCALE, causal=True, block_size=16, window=window)
    assert bits_equal(full, consistent_attention(q, k, v, SCALE, causal=True, block_size=16, excluded=hidden))
    exact = _math_attention(q.float(), k.float(), v.float(), SCALE, True, None, None, window)
    assert (full.float() - exact).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    if window < 159:
        assert not bits_equal(full, consistent_attention(q, k, v, SCALE, causal=True, block_size=16))
    for lo, hi in ((0, 7), (7, 40), (40, 129), (129, 160)):
        chunk = consistent_attention(q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], SCALE, causal=True,
                                     q_positions=torch.arange(lo, hi), block_size=16, window=window)
        assert bits_equal(chunk, full[:, :, lo:hi]), (lo, hi)
    pages = k.shape[2] // 16  # a paged cache of 16-key pages holding the whole sequence
    k_cache = k[0].permute(1, 0, 2).reshape(pages, 16, k.shape[1], k.shape[3])
    v_cache = v[0].permute(1, 0, 2).reshape(pages, 16, v.shape[1], v.shape[3])
    table = torch.arange(pages).view(1, -1)
    for p in (0, 23, 24, 100, 159):
        step = decode_attention(q[:, :, p:p + 1], k_cache, v_cache, torch.tensor([p + 1]), table, SCALE,
                                block_size=16, window=window)
        assert bits_equal(step, full[:, :, p:p + 1]), p


@pytest.mark.parametrize("backend", ["triton", "npu"])
def test_a_backend_with_one_head_size_refuses_a_value_head_size_of_its_own_by_name(backend):
    """Multi-latent attention's values (128 wide against 192 for q / k) run on the torch backend only."""
    import importlib

    module = importlib.import_module(f"mindspeed_tp.kernels.backends.{backend}")
    q, v = torch.zeros(1, 2, 4, 24), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ConfigError, match=f"value head size \\(16\\) other than .* \\(24\\).* the {backend} backend"):
        module.attention(q, q, v, SCALE, True)
    k_cache, v_cache = torch.zeros(1, 4, 2, 24), torch.zeros(1, 4, 2, 16)
    with pytest.raises(ConfigError, match="value head size"):
        module.decode_attention(q, k_cache, v_cache, torch.tensor([4]), torch.zeros(1, 1, dtype=torch.long), SCALE)


@pytest.mark.parametrize("backend", ["triton", "npu"])
def test_a_backend_without_a_window_kernel_refuses_the_window_by_name(backend):
    import importlib

    module = importlib.import_module(f"mindspeed_tp.kernels.backends.{backend}")
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ConfigError, match=f"the {backend} backend's kernel does not implement it"):
        module.attention(q, q, q, SCALE, True, window=3)
    cache = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ConfigError, match="window_size"):
        module.decode_attention(q, cache, cache, torch.tensor([4]), torch.zeros(1, 1, dtype=torch.long), SCALE,
                                window=3)


@pytest.mark.parametrize("dim,base,factor,original", [(64, 10000, 40.0, 4096), (64, 50000, 32.0, 4096),
                                                      (32, 10000, 4.0, 2048)])
def test_yarn_frequencies_are_megatrons_and_transformers_bit_for_bit(monkeypatch, dim, base, factor, original):
    """DeepSeek-V3's rope_type yarn (factor 40 over 4096 positions, a 64-wide rope head), Kimi-K2's
    base, a small case: the frequencies megatron-core's YarnRotaryEmbedding rotates position 1 by,
    and transformers' yarn initialisation, bit for bit; not the plain ones."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mindspeed_tp.kernels.rope import rope_inv_freq, yarn_inv_freq, yarn_mscale

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # megatron moves its tables to the GPU
    theirs = YarnRotaryEmbedding(dim, rotary_base=base, scaling_factor=factor,
                                 original_max_position_embeddings=original, use_cpu_initialization=True)
    emb, concentration = theirs.get_emb(2)
    ours = yarn_inv_freq(dim, base, factor, original)
    assert bits_equal(ours, emb[1, 0, 0, : dim // 2])
    assert concentration == yarn_mscale(factor)
    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": float(base)}
    config = DeepseekV3Config(qk_rope_head_dim=dim, rope_parameters=rope, max_position_embeddings=original * 4)
    hf, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert bits_equal(ours, hf.float())
    assert not bits_equal(ours, rope_inv_freq(dim, base))


@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_mla_rope_deinterleaves_then_rotates_by_halves_as_megatron(mscale):
    """Megatron's multi-latent attention RoPE (rope channels stored interleaved, rotated as even
    channels then odd ones; YaRN's mscale on cos / sin): fp32 semantics against megatron's own
    function, and bit for bit our half-layout rotation of the de-interleaved channels."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from mindspeed_tp.kernels.rope import apply_rope, rope_angles, rope_inv_freq

    t = _randn(10, 2, 4, 24, seed=50)  # [s, b, heads, 24]: 16 rope channels, 8 passed through
    angles = rope_angles(torch.arange(10), rope_inv_freq(16, 10000)).reshape(10, 1, 1, 16)
    ours = apply_rope(t, angles, deinterleave=True, mscale=mscale)
    theirs = _apply_rotary_pos_emb_bshd(t, angles, multi_latent_attention=True, mscale=mscale)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    halves = torch.cat((t[..., 0:16:2], t[..., 1:16:2], t[..., 16:]), dim=-1)
    plain = apply_rope(halves, angles, mscale=mscale)
    assert bits_equal(ours, plain)
    assert not torch.allclose(ours, apply_rope(t, angles, mscale=mscale))
