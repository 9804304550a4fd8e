"""The triton kernel backend (mindspeed_tp/kernels/backends/triton.py), its invariances as specifications.

Here (no GPU) the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set
before the kernels module is imported); ``MINDSPEED_TP_TRITON_DEVICE=cuda`` runs the same tests on
a GPU with the compiled kernels (scripts/device_check.sh does).

What the interpreter proves: the kernels' tiling, masking, block visiting order, online-softmax
state, split merging, page addressing and the wrappers' strides and launches give a row's result
independent of M, of the other rows and of its place in a tile, a column's independent of the
column shard, and bitwise-equal attention across training, chunked prefill and paged decode and
across batch composition; and that the results have the torch reference's semantics (within a
tolerance: the summation inside a tile differs).

What it does not prove: the compiled kernels' code generation. The interpreter replaces ``tl.dot``
with an in-order fp32 product sum (its own dot is numpy's BLAS, not row-invariant, see
triton_kernels.py), its bf16 casts are done by torch, and it runs every program with numpy, so
the tensor-core MMA accumulation order, the compiled reductions (``tl.max`` across threads and
warps), ``tl.exp``'s hardware approximation and FMA contraction are only exercised on a GPU. That
every call site compiles to one binary per numerics (no specialisation on argument values or
alignment) is checked on a CPU by tests/test_triton_compiled.py. The same assertions hold on a GPU
iff the compiled kernels keep the invariance.
"""
import importlib
import os
import sys
import warnings

import pytest
import torch

from mindspeed_tp.errors import ConfigError
from mindspeed_tp.kernels.backends import torch as torch_backend
from mindspeed_tp.kernels.backends.torch import _blocked_attention
from mindspeed_tp.kernels.linear import leaf_partials
from mindspeed_tp.contract.tree import tree_fold
from conftest import bits_equal

DEVICE = os.environ.get("MINDSPEED_TP_TRITON_DEVICE", "cpu")


def _import_backend():
    """The backend and its kernels module, the kernels built for DEVICE (interpreted on CPU)."""
    previous = os.environ.get("TRITON_INTERPRET")
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        backend = importlib.import_module("mindspeed_tp.kernels.backends.triton")
        kernels = importlib.import_module("mindspeed_tp.kernels.backends.triton_kernels")
        if kernels.INTERPRETED != (DEVICE == "cpu"):  # imported earlier under the other mode
            kernels = importlib.reload(kernels)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return backend, kernels


tb, tk = _import_backend()


@pytest.fixture(scope="module", autouse=True)
def interpreter_mode():
    """Triton reads TRITON_INTERPRET again while running (lazy imports): on for this module's tests
    only, so the rest of the suite (and the processes it starts) never sees it."""
    if DEVICE != "cpu":
        yield
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _perm(n, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


# --------------------------------------------------------------------------- GEMM

# K=96 and N=80 are not multiples of either tile config: the masked K tail and column edge run.
K, N, M_FULL = 96, 80, 1030


@pytest.fixture(scope="module", params=DTYPES, ids=DTYPE_IDS)
def gemm_case(request):
    dtype = request.param
    x = _randn(M_FULL, K, seed=1, dtype=dtype)
    w = _randn(N, K, seed=2, dtype=dtype)
    return x, w, tb.matmul(x, w.t())


def test_matmul_is_row_invariant_in_m(gemm_case):
    """M = 1..64 and a few large M: each row's bits equal the same row of the 1030-row product."""
    x, w, full = gemm_case
    for m in list(range(1, 65)) + [127, 129, 300]:
        assert bits_equal(tb.matmul(x[:m], w.t()), full[:m]), f"M={m}"


def test_matmul_row_depends_only_on_itself(gemm_case):
    """Rows gathered from anywhere (so at other places in a tile, next to other rows) keep their bits."""
    x, w, full = gemm_case
    for seed, count in ((3, 37), (4, 200), (5, M_FULL)):
        idx = _perm(M_FULL, seed)[:count]
        assert bits_equal(tb.matmul(x[idx], w.t()), full[idx]), f"{count} permuted rows"


def test_matmul_is_column_shard_invariant(gemm_case):
    """A rank's contiguous column shard (a view or its own copy) gives the full product's columns."""
    x, w, full = gemm_case
    x, full, wt = x[:150], full[:150], w.t()
    for shards in (2, 4, 5):
        width = N // shards
        for r in range(shards):
            cols = slice(r * width, (r + 1) * width)
            assert bits_equal(tb.matmul(x, wt[:, cols]), full[:, cols]), f"{shards} shards, shard {r} (view)"
            assert bits_equal(tb.matmul(x, wt[:, cols].contiguous()), full[:, cols]), f"shard {r} (copy)"


def test_matmul_matches_torch_semantics(gemm_case):
    """fp32 result of the fp32 product (tolerance: the summation order inside a tile differs)."""
    x, w, full = gemm_case
    assert full.dtype == torch.float32
    torch.testing.assert_close(full, x.float() @ w.float().t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_adds_bias_in_fp32_and_casts_once(dtype):
    x = _randn(70, K, seed=6, dtype=dtype)
    w = _randn(N, K, seed=7, dtype=dtype)
    bias = _randn(N, seed=8, dtype=dtype)
    for out_dtype in (dtype, torch.float32):
        y = tb.linear(x, w, out_dtype, bias=bias)
        assert y.dtype == out_dtype
        # Bitwise: fp32 accumulator + fp32 bias, then one cast (no intermediate rounding).
        assert bits_equal(y, (tb.matmul(x, w.t()) + bias.float()).to(out_dtype))
        for m in (1, 3, 17, 64):
            assert bits_equal(tb.linear(x[:m], w, out_dtype, bias=bias), y[:m]), f"M={m}"
    assert bits_equal(tb.linear(x, w, dtype), tb.matmul(x, w.t()).to(dtype))
    ref = (x.float() @ w.float().t() + bias.float()).to(dtype)
    torch.testing.assert_close(tb.linear(x, w, dtype, bias=bias), ref, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-4 if dtype == torch.float32 else 1e-2)


def test_mixed_dtypes_are_computed_in_fp32():
    """A bf16 input to an fp32 weight (the router) is one fp32 GEMM of the upcast values."""
    x = _randn(33, K, seed=9, dtype=torch.bfloat16)
    w = _randn(N, K, seed=10)
    assert bits_equal(tb.matmul(x, w.t()), tb.matmul(x.float(), w.t()))


# --------------------------------------------------------------------------- canonical-tree leaves

C = 8
KL = 24  # leaf width: not a tile multiple either


def _leaf_views(x, w, leaves):
    """(L, M, kl) and (L, kl, N) strided views of x (M, L*kl) and w (N, L*kl): no copies."""
    m, n = x.shape[0], w.shape[0]
    return x.reshape(m, leaves, KL).transpose(0, 1), w.reshape(n, leaves, KL).permute(1, 2, 0)


class _LaunchCounter:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_leaves_are_one_launch_and_equal_single_leaf_gemms(dtype, monkeypatch):
    x = _randn(45, C * KL, seed=11, dtype=dtype)
    w = _randn(N, C * KL, seed=12, dtype=dtype)
    counter = _LaunchCounter(tk.gemm_kernel)
    monkeypatch.setattr(tk, "gemm_kernel", counter)
    leaves = tb.matmul(*_leaf_views(x, w, C))
    assert counter.launches == 1
    monkeypatch.undo()
    assert leaves.shape == (C, 45, N) and leaves.dtype == torch.float32
    for i in range(C):
        cols = slice(i * KL, (i + 1) * KL)
        assert bits_equal(leaves[i], tb.matmul(x[:, cols], w[:, cols].t())), f"leaf {i}"
    # Semantics of the torch reference's leaf_partials (tolerance: other summation inside a tile).
    ref = leaf_partials(x.cpu(), w.cpu(), C).to(DEVICE)
    torch.testing.assert_close(leaves, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tree_of_rank_subtrees_equals_single_device_tree(dtype):
    """TP ranks computing their C/TP leaves (one launch each, on their own K shard, any row subset)
    and folding the subtrees in rank order give the single-device tree's bits."""
    x = _randn(52, C * KL, seed=13, dtype=dtype)
    w = _randn(N, C * KL, seed=14, dtype=dtype)
    single = tree_fold(tb.matmul(*_leaf_views(x, w, C)), dim=0)
    rows = _perm(52, 15)[:19]
    for tp in (1, 2, 4, 8):
        k_rank = C * KL // tp
        subtrees = []
        for r in range(tp):
            ks = slice(r * k_rank, (r + 1) * k_rank)
            subtrees.append(tree_fold(tb.matmul(*_leaf_views(x[:, ks].contiguous(), w[:, ks].contiguous(),
                                                             C // tp)), dim=0))
        assert bits_equal(tree_fold(torch.stack(subtrees), dim=0), single), f"TP={tp}"
        sub = tree_fold(tb.matmul(*_leaf_views(x[rows, : k_rank], w[:, : k_rank], C // tp)), dim=0)
        first = tree_fold(tb.matmul(*_leaf_views(x[:, : k_rank], w[:, : k_rank], C // tp)), dim=0)
        assert bits_equal(sub, first[rows]), f"TP={tp}: row subset of rank 0's subtree"


# --------------------------------------------------------------------------- row reductions

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_sum_fixed_order_per_row(dtype):
    x = _randn(70, 2500, seed=16, dtype=dtype)  # 2500: three 1024-wide steps, the last one masked
    full = tb.row_sum(x)
    assert full.dtype == torch.float32 and full.shape == (70,)
    for idx in (torch.arange(1, device=DEVICE), torch.arange(33, device=DEVICE), _perm(70, 17)[:41]):
        assert bits_equal(tb.row_sum(x[idx]), full[idx])
    torch.testing.assert_close(full, x.float().sum(-1), rtol=1e-5, atol=1e-3)
    x3 = x.reshape(7, 10, 2500)
    assert bits_equal(tb.row_sum(x3, keepdim=True), full.reshape(7, 10, 1))
    # The vocab leaf sums of the log-softmax: rows of (tokens, leaves, V/C), leaves in any grouping.
    leaves = x.float().reshape(70, 4, 625)
    assert bits_equal(tb.row_sum(leaves)[:, 2:], tb.row_sum(leaves[:, 2:].contiguous()))


def test_softmax_per_row():
    x = _randn(50, 64, seed=18) * 3
    full = tb.softmax(x)
    idx = _perm(50, 19)[:23]
    assert bits_equal(tb.softmax(x[idx]), full[idx])
    assert bits_equal(tb.softmax(x[:1]), full[:1])
    torch.testing.assert_close(full, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    assert tb.softmax(x.to(torch.bfloat16)).dtype == torch.float32


def test_gradients_follow_the_plain_formulas():
    """Backward is not part of the contract; it must still be the math of the forward."""
    a = _randn(3, 5, 7, seed=24).requires_grad_()
    b = _randn(7, 4, seed=25).requires_grad_()
    tb.matmul(a, b).sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(3, 5, 4, device=DEVICE) @ b.detach().t())
    torch.testing.assert_close(b.grad, a.detach().reshape(-1, 7).t() @ torch.ones(15, 4, device=DEVICE))
    s = _randn(6, 9, seed=26).requires_grad_()
    (tb.softmax(s) * _randn(6, 9, seed=27)).sum().backward()
    sr = s.detach().clone().requires_grad_()
    (torch.softmax(sr, -1) * _randn(6, 9, seed=27)).sum().backward()
    torch.testing.assert_close(s.grad, sr.grad, rtol=1e-5, atol=1e-6)
    r = _randn(4, 9, seed=28).requires_grad_()
    (tb.row_mean(r) * 9).sum().backward()
    assert bits_equal(r.grad, torch.ones_like(r))


def _attention_grads(fn, q, k, v, g, **kw):
    """(dq, dk, dv) of sum(fn(q, k, v, ...) * g)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    (fn(*leaves, SCALE, **kw).float() * g).sum().backward()
    return [t.grad for t in leaves]


# (case id, keyword arguments of attention, the query slice): causal training, a chunk at later
# positions (CP's local queries / chunked prefill), key padding without the causal flag, a split.
BACKWARD_CASES = {
    "causal": (dict(causal=True), slice(None)),
    "chunk": (dict(causal=True, q_positions=torch.arange(23, 61)), slice(23, 61)),
    "padding": (dict(causal=False, excluded="padding"), slice(None)),
    "padding-causal": (dict(causal=True, excluded="padding-causal"), slice(None)),
    "split": (dict(causal=True, split_size=32), slice(None)),
}


def _backward_inputs(dtype, name):
    kw, rows = dict(BACKWARD_CASES[name][0]), BACKWARD_CASES[name][1]
    q = _randn(B_, HQ, S, D, seed=33, dtype=dtype)[:, :, rows]
    k, v = (_randn(B_, HKV, S, D, seed=s, dtype=dtype) for s in (34, 35))
    g = _randn(*q.shape, seed=36)
    if "q_positions" in kw:
        kw["q_positions"] = kw["q_positions"].to(DEVICE)
    pad = torch.arange(S, device=DEVICE).view(1, 1, 1, S) >= torch.tensor(LENGTHS, device=DEVICE).view(B_, 1, 1, 1)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool, device=DEVICE), diagonal=1).view(1, 1, S, S)
    if kw.get("excluded") == "padding":
        kw["excluded"] = pad
    elif kw.get("excluded") == "padding-causal":
        kw["excluded"] = pad | causal
    return q, k, v, g, dict(kw, block_size=16)


@pytest.mark.parametrize("name", list(BACKWARD_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_backward_has_exact_attentions_gradient(dtype, name):
    """The backward kernels (delta, dK / dV per key block, dQ per query block) give the gradient of
    exact attention: the torch reference's recompute within rounding (fp32: 1e-5; bf16: P and dS
    rounded to bf16 before their products, as FlashAttention's backward), GQA's dK / dV summed over
    the group's query heads; a key no query sees (key padding) gets exactly zero."""
    q, k, v, g, kw = _backward_inputs(dtype, name)
    ours = _attention_grads(tb.attention, q, k, v, g, **kw)
    ref = _attention_grads(torch_backend.attention, q.cpu(), k.cpu(), v.cpu(), g.cpu(), **{
        key: (val.cpu() if torch.is_tensor(val) else val) for key, val in kw.items()})
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for name_, a, r in zip("qkv", ours, ref):
        assert a.dtype == dtype and a.shape == r.shape, name_
        torch.testing.assert_close(a.float().cpu(), r.float(), **tol, msg=lambda m: f"d{name_}: {m}")
    if name.startswith("padding"):
        for grad in ours[1:]:
            for entry, length in enumerate(LENGTHS):
                assert bits_equal(grad[entry, :, length:], torch.zeros_like(grad[entry, :, length:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_backward_is_invariant_to_batch_composition_and_head_split(dtype):
    """A head's gradients are its own: computed with the batch's other entries or alone, and with
    the heads split as TP splits them (each rank its query heads and their kv head), the same bits."""
    hq, hkv = 4, 2
    q = _randn(B_, hq, S, D, seed=37, dtype=dtype)
    k, v = (_randn(B_, hkv, S, D, seed=s, dtype=dtype) for s in (38, 39))
    g = _randn(*q.shape, seed=40)
    full = _attention_grads(tb.attention, q, k, v, g, causal=True, block_size=16)
    for order in ([2], [2, 0]):
        part = _attention_grads(tb.attention, q[order], k[order], v[order], g[order], causal=True, block_size=16)
        for name, a, b in zip("qkv", part, full):
            assert bits_equal(a, b[order]), f"d{name}, batch {order}"
    for rank in range(2):  # TP 2: query heads [2r, 2r+1], kv head r
        heads, kv = slice(2 * rank, 2 * rank + 2), slice(rank, rank + 1)
        part = _attention_grads(tb.attention, q[:, heads], k[:, kv], v[:, kv], g[:, heads], causal=True,
                                block_size=16)
        for name, a, b in zip("qkv", part, (full[0][:, heads], full[1][:, kv], full[2][:, kv])):
            assert bits_equal(a, b), f"d{name}, TP rank {rank}"


@pytest.mark.parametrize("d", [16, 48, 192, 256])
def test_a_head_dim_the_kernels_are_not_checked_for_is_refused_by_name(d):
    """Only the head dims scripts/compile_triton_kernels.py compiles without spills are run (192 and
    256 spill at every tile tried); any other is a ConfigError naming the backend setting."""
    q = _randn(1, 1, 4, d, seed=41)
    with pytest.raises(ConfigError, match=f"head dim {d} .*backend: torch"):
        tb.attention(q, q, q, SCALE, True)
    with pytest.raises(ConfigError, match=f"head dim {d} "):
        tb.decode_attention(q, q.transpose(1, 2), q.transpose(1, 2), torch.tensor([4], dtype=torch.int32),
                            torch.zeros(1, 1, dtype=torch.int32), SCALE)


# --------------------------------------------------------------------------- attention

B_, HQ, HKV, S, D = 3, 2, 1, 70, 32  # S=70: several query tiles, the last one partial; GQA (2 query heads per kv head)
LENGTHS = (70, 51, 17)  # each request's real length in the right-padded training batch
SCALE = 0.25


# (dtype, block B, split S, page size of the decode cache)
@pytest.fixture(scope="module", params=[(torch.float32, 16, None, 8), (torch.float32, 16, 32, 12),
                                        (torch.bfloat16, 12, None, 5)],
                ids=["fp32-B16-page8", "fp32-B16-split32-page12", "bf16-B12-page5"])
def attn_case(request):
    dtype, block, split, page = request.param
    q = _randn(B_, HQ, S, D, seed=30, dtype=dtype)
    k = _randn(B_, HKV, S, D, seed=31, dtype=dtype)
    v = _randn(B_, HKV, S, D, seed=32, dtype=dtype)
    train = tb.attention(q, k, v, SCALE, causal=True, block_size=block, split_size=split)
    return q, k, v, block, split, page, train


def test_attention_matches_torch_reference_semantics(attn_case):
    q, k, v, block, split, _, train = attn_case
    assert train.shape == q.shape and train.dtype == q.dtype
    ref = _blocked_attention(q.cpu(), k.cpu(), v.cpu(), SCALE, True, block_size=block, split_size=split).to(DEVICE)
    fp32 = q.dtype == torch.float32
    torch.testing.assert_close(train, ref, rtol=1e-5 if fp32 else 1.6e-2, atol=1e-5 if fp32 else 1.6e-2)


def test_explicit_causal_mask_equals_causal_flag(attn_case):
    """Megatron passes its causal mask as well: excluding the same keys by mask gives the same bits."""
    q, k, v, block, split, _, train = attn_case
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=DEVICE), diagonal=1).view(1, 1, S, S)
    assert bits_equal(tb.attention(q, k, v, SCALE, True, excluded=mask, block_size=block, split_size=split), train)
    assert bits_equal(tb.attention(q, k, v, SCALE, False, excluded=mask, block_size=block, split_size=split), train)


def test_chunked_prefill_equals_training(attn_case):
    """Chunks at any boundary (inside a key block, across query tiles) read the keys so far."""
    q, k, v, block, split, _, train = attn_case
    for start, stop in ((0, 7), (7, 23), (23, 66), (66, 70)):
        pos = torch.arange(start, stop, device=DEVICE)
        chunk = tb.attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], SCALE, True, q_positions=pos,
                             block_size=block, split_size=split)
        assert bits_equal(chunk, train[:, :, start:stop]), f"chunk [{start}, {stop})"


def test_training_is_invariant_to_batch_composition(attn_case):
    q, k, v, block, split, _, train = attn_case
    for order in ([2], [2, 0, 1]):
        sub = tb.attention(q[order], k[order], v[order], SCALE, True, block_size=block, split_size=split)
        assert bits_equal(sub, train[order]), f"batch {order}"


def _paged_cache(k, v, lengths, page_size, seed):
    """Each request's first ``length`` keys scattered over a shuffled page pool (one extra page unused)."""
    pages_per = [-(-n // page_size) for n in lengths]
    total = sum(pages_per) + 1
    ids = _perm(total, seed)
    k_cache = torch.full((total, page_size, k.shape[1], k.shape[3]), float("nan"), dtype=k.dtype, device=DEVICE)
    v_cache = k_cache.clone()
    table = torch.zeros(len(lengths), max(pages_per), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(lengths):
        for p in range(pages_per[i]):
            page = int(ids[used])
            used += 1
            table[i, p] = page
            keys = slice(p * page_size, min(n, (p + 1) * page_size))
            width = keys.stop - keys.start
            k_cache[page, :width] = k[i, :, keys].transpose(0, 1)
            v_cache[page, :width] = v[i, :, keys].transpose(0, 1)
    # Unwritten page slots hold NaN: a read past a request's keys would show in the output.
    return k_cache, v_cache, table


def test_paged_decode_equals_training(attn_case):
    """A decode step (1 or 3 new tokens per request) over a shuffled paged cache, batched with
    requests of other lengths or alone, gives each request's training rows bit for bit."""
    q, k, v, block, split, page_size, train = attn_case
    for step, sq in ((0, 1), (9, 3)):  # each request's last token; 3 tokens ending 9 tokens earlier
        lengths = [n - step for n in LENGTHS]
        k_cache, v_cache, table = _paged_cache(k, v, lengths, page_size, seed=40 + page_size + step)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        qs = torch.stack([q[i, :, n - sq:n] for i, n in enumerate(lengths)])
        want = torch.stack([train[i, :, n - sq:n] for i, n in enumerate(lengths)])
        out = tb.decode_attention(qs, k_cache, v_cache, seqlens, table, SCALE, block_size=block,
                                  split_size=split)
        assert bits_equal(out, want), f"page {page_size}, step {step}, sq={sq}"
        for order in ([1], [2, 0]):
            alone = tb.decode_attention(qs[order], k_cache, v_cache, seqlens[order], table[order], SCALE,
                                        block_size=block, split_size=split)
            assert bits_equal(alone, want[order]), f"batch {order}"


def test_key_padding_mask_equals_shorter_keys():
    """Non-causal attention with a request's padding keys excluded equals attention over its real keys."""
    q = _randn(B_, HQ, 10, D, seed=33)
    k = _randn(B_, HKV, S, D, seed=34)
    v = _randn(B_, HKV, S, D, seed=35)
    pad = torch.arange(S, device=DEVICE).view(1, 1, 1, S) >= torch.tensor(LENGTHS, device=DEVICE).view(B_, 1, 1, 1)
    out = tb.attention(q, k, v, SCALE, causal=False, excluded=pad, block_size=16)
    for i, n in enumerate(LENGTHS):
        alone = tb.attention(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], SCALE, causal=False, block_size=16)
        assert bits_equal(out[i:i + 1], alone), f"request {i}"
    # A query that sees no key gives 0, as the reference.
    nothing = torch.ones(1, 1, 1, S, dtype=torch.bool, device=DEVICE)
    assert bits_equal(tb.attention(q, k, v, SCALE, False, excluded=nothing, block_size=16), torch.zeros_like(q))


def test_a_mask_other_than_causal_or_key_padding_is_refused():
    """The kernel reads no dense mask (one compiled variant for every call site): a mask that is not
    megatron's causal mask or key padding (or both) is refused by name, not run some other way."""
    q, k, v = (_randn(1, HQ, 12, D, seed=s) for s in (60, 61, 62))
    causal = torch.triu(torch.ones(12, 12, dtype=torch.bool, device=DEVICE), diagonal=1).view(1, 1, 12, 12)
    for mask in (causal.transpose(-1, -2), causal | torch.eye(12, dtype=torch.bool, device=DEVICE),
                 torch.zeros(1, 1, 12, 12, dtype=torch.bool, device=DEVICE).index_fill_(-1,
                 torch.tensor([3], device=DEVICE), True)):  # anti-causal, a diagonal hidden, a hole in the keys
        with pytest.raises(ConfigError, match="triton backend's attention.*neither"):
            tb.attention(q, k, v, SCALE, False, excluded=mask, block_size=16)
    # Megatron's causal mask, alone or with key padding, is the causal flag and a key length.
    pad = (torch.arange(12, device=DEVICE) >= 9).view(1, 1, 1, 12)
    assert bits_equal(tb.attention(q, k, v, SCALE, False, excluded=causal | pad, block_size=16)[:, :, :9],
                      tb.attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], SCALE, True, block_size=16))


def test_attention_rejects_bad_shapes():
    q = _randn(1, 3, 4, D, seed=36)
    k = _randn(1, 2, 4, D, seed=37)
    with pytest.raises(ValueError, match="not divisible"):
        tb.attention(q, k, k, SCALE)
    with pytest.raises(ValueError, match="split_size"):
        tb.attention(q[:, :2], k, k, SCALE, block_size=16, split_size=24)


# --------------------------------------------------------------------------- enable-time preparation

@pytest.fixture
def saved_torch_settings():
    saved = [(get, set_, get()) for _, get, set_, _, _ in tb._settings()]
    yield
    for _, set_, value in saved:
        set_(value)


def test_prepare_without_triton_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    with pytest.raises(ConfigError, match="'triton'.*backend: torch"):
        tb.prepare(None)
    assert tb.available() is False


def test_prepare_pins_tf32_and_cudnn_and_names_a_conflicting_setting(saved_torch_settings):
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True  # torch's default: pinned without a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        changed = tb.prepare(None)
    messages = [str(w.message) for w in caught]
    assert any("torch.backends.cuda.matmul.allow_tf32=True" in m for m in messages), messages
    assert any("torch.backends.cudnn.benchmark=True" in m for m in messages), messages
    assert not any("cudnn.allow_tf32" in m for m in messages), messages
    assert {"torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.benchmark",
            "torch.backends.cudnn.allow_tf32"} <= set(changed)
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic is True
    assert torch.get_float32_matmul_precision() == "highest"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tb.prepare(None) == []  # pinned: nothing left to change or say
    assert not caught


def test_available_needs_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tb.available() is True
    monkeypatch.delenv("TRITON_INTERPRET")
    assert tb.available() is False


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(tk, "INTERPRETED", False)
    with pytest.raises(ValueError, match="CUDA tensors"):
        tb.matmul(torch.ones(2, 2), torch.ones(2, 2))


# --------------------------------------------------------------------------- through the dispatcher

@pytest.fixture
def triton_selected():
    from mindspeed_tp.kernels import dispatch

    dispatch.select("triton")  # what backend: auto picks for CUDA tensors; forced here for CPU ones
    yield
    dispatch.select("auto")


def test_composite_kernels_run_on_the_triton_primitives(triton_selected, monkeypatch):
    """The kernel interface (written once over the primitives) with every primitive from this
    backend: same semantics as on the torch reference, the invariances kept."""
    from mindspeed_tp.kernels import (consistent_attention, dispatch, folded_leaf_partials, invariant_linear,
                                      rms_norm, vocab_parallel_logprob)
    from mindspeed_tp.kernels.moe import route

    calls = []
    module = dispatch.backend_module("triton")
    for name in dispatch.PRIMITIVES:
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    x = _randn(40, C * KL, seed=50, dtype=torch.bfloat16)
    w = _randn(N, C * KL, seed=51, dtype=torch.bfloat16)
    bias = _randn(N, seed=52, dtype=torch.bfloat16)
    y = invariant_linear(x, w, bias)
    assert bits_equal(invariant_linear(x[:7], w, bias), y[:7])
    torch.testing.assert_close(y, (x.float() @ w.float().t() + bias.float()).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    assert bits_equal(invariant_linear(x[5:9], w), invariant_linear(x, w)[5:9])
    sub = folded_leaf_partials(x, w, C)
    assert bits_equal(folded_leaf_partials(x[:3], w, C), sub[:3])
    torch.testing.assert_close(sub, x.float() @ w.float().t(), rtol=1e-4, atol=1e-3)
    h = _randn(30, 64, seed=53)
    torch.testing.assert_close(rms_norm(h, None, 1e-6), h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    # small: the interpreter runs the logprob's leaf programs one by one (12 x 1024 took a minute)
    logits = _randn(4, 256, seed=54)
    target = torch.randint(0, 250, (4,), generator=torch.Generator().manual_seed(55)).to(DEVICE)
    lp = vocab_parallel_logprob(logits, target, None, canonical_shards=8, vocab_size=250)
    ref = torch.log_softmax(logits[:, :250], -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    idx, probs = route(_randn(10, 8, seed=56), 2, "softmax", pre_softmax=True)
    assert idx.shape == (10, 2) and torch.all(probs > 0)
    q, k, v = (_randn(1, 2, 20, D, seed=s) for s in (57, 58, 59))
    assert bits_equal(consistent_attention(q, k, v, SCALE, block_size=16), tb.attention(q, k, v, SCALE, block_size=16))
    assert {"linear", "matmul", "row_sum", "row_mean", "softmax", "attention"} <= set(calls), sorted(set(calls))


def test_the_triton_backend_names_its_build_for_reports_and_reference_files():
    """The compiled kernels' bits depend on the Triton version and the FP contraction pinned at launch:
    the backend running a device says so (check's report rows, the ranks' comparison, a reference
    file's metadata); the CPU's torch backend declares nothing."""
    import triton

    from mindspeed_tp.kernels import dispatch

    assert dispatch.build_identity("cpu") == {}
    assert dispatch.build_identity("cuda") == {"triton": triton.__version__, "enable_fp_fusion": True}


def test_disable_puts_back_the_settings_enable_pinned(saved_torch_settings, monkeypatch):
    """Issue #55: enable() pinned TF32 / cuDNN / reduced-precision flags process-wide and disable()
    left them pinned; the user's values come back with disable()."""
    from mindspeed_tp.kernels import dispatch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tb.prepare(None)
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.benchmark is False
    monkeypatch.setitem(dispatch._modules, "triton", tb)  # the loaded backend disable() releases
    dispatch.release()
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.benchmark is True
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is reduced
    assert tb.restore_torch_settings() == []  # nothing pinned is left
