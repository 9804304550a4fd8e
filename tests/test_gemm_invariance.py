"""The torch backend's GEMMs give the same bits for a row whatever M, for a column whatever shard of
N holds it, and whatever the thread count, at shapes real models have (non-powers of two, column
tails, K up to 8192) and in fp32 and bf16 -- by construction (every library call one single-threaded
call of one shape: ROW_TILE rows by COLUMN_TILE output columns, zero-padded), not because the host's
BLAS happens to choose one kernel.

The libraries choose by the CPU, so each run names its CPU (pytest's header, and the assertion
messages), and the sweep runs again in a fresh process under every ISA limit below the host's
(``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``): one host tests the code paths of every CPU it
can emulate. History: one library call over a rank's N columns failed the shard sweep on an AMD EPYC
with AVX-512 (208 of 2464 cases); rows padded only to a multiple of 16, with the library's own
threads, failed on an Intel Xeon with AMX (bf16 rows past the AMX switch at 17-33 rows; fp32 with 2
threads against 1 at every M); 512-column tiles failed the shard sweep on that Xeon under
MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL's 24-wide panels: a tail panel inside every tile).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import _env, bits_equal, explain, host_cpu, run_cli, torch_threads
from mindspeed_tp.devices import cpu_isa
from mindspeed_tp.kernels import invariant_linear, leaf_partials
from mindspeed_tp.kernels.backends import torch as torch_backend

HERE = os.path.dirname(os.path.abspath(__file__))

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _randn(*shape, seed, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _bits(t):
    return t.contiguous().view(BITS[t.dtype])


def _same(a, b) -> bool:
    return a.dtype == b.dtype and bits_equal(_bits(a), _bits(b))


# K and N: odd multiples of 16 and other non-powers of two from 24 to 4100, and powers of two.
SHAPES = [(24, 8), (72, 200), (208, 1152), (400, 72), (576, 1000), (1040, 3000), (3088, 4100), (4096, 1552)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_a_column_does_not_depend_on_the_shard_that_holds_it(dtype, k, n):
    x = _randn(160, k, seed=k, dtype=dtype)
    w = _randn(n, k, seed=n, dtype=dtype, scale=k ** -0.5)
    with torch_threads(1):
        full = invariant_linear(x, w)
        bad = []
        for width in sorted({n // 2, n // 3, n // 4, n // 8, 7, 17, 130} - {0}):
            for start in sorted({0, (n - width) // 2, n - width}):
                if not _same(invariant_linear(x, w[start:start + width]), full[:, start:start + width]):
                    bad.append((start, width))
    assert bad == [], f"K={k} N={n} {dtype}: columns (start, width) differ from the full N: {bad} on {host_cpu()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("k,n", [(256, 128), (1040, 400)])
def test_gradient_gemms_of_a_shard_are_the_full_gemms_columns(dtype, k, n):
    """Bitwise training's gradient GEMMs pass transposed views whose strides follow the shard width:
    dW of a rank's input columns (a row-parallel fc2 holding K/TP of x), dW of a rank's output rows (a
    column-parallel layer; N/TP rows, padded to 16 at N=400, TP=8) and dx of a rank's weight columns
    are the full GEMM's. (On a CPU without AVX-512-BF16, torch's bf16 GEMM
    accumulated a transposed operand in another order: TP=4 fc2 gradients differed.)"""
    from mindspeed_tp.kernels.linear import invariant_input_grad, invariant_weight_grad

    tokens = 96
    x = _randn(tokens, k, seed=k + 7, dtype=dtype)
    dy = _randn(tokens, n, seed=n + 7, dtype=dtype)
    weight = _randn(n, k, seed=k + n, dtype=dtype, scale=k ** -0.5)
    with torch_threads(1):
        dw = invariant_weight_grad(dy, x, dtype, 16)
        dx = invariant_input_grad(dy, weight, dtype, 16)
        bad = []
        for tp in (2, 4, 8):
            width = k // tp
            for rank in range(tp):
                cols = slice(rank * width, (rank + 1) * width)
                if not _same(invariant_weight_grad(dy, x[:, cols].contiguous(), dtype, 16), dw[:, cols]):
                    bad.append(("dW", tp, rank))
                if not _same(invariant_input_grad(dy, weight[:, cols].contiguous(), dtype, 16), dx[:, cols]):
                    bad.append(("dx", tp, rank))
                out = slice(rank * (n // tp), (rank + 1) * (n // tp))  # a column-parallel rank's dW rows
                if not _same(invariant_weight_grad(dy[:, out].contiguous(), x, dtype, 16), dw[out]):
                    bad.append(("dW rows", tp, rank))
    assert bad == [], f"K={k} N={n} {dtype}: shards differ from the full gradient GEMM: {bad} on {host_cpu()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("k,n", SHAPES[::2])
def test_a_row_does_not_depend_on_how_many_rows_were_computed_with_it(dtype, k, n):
    x = _randn(300, k, seed=k + 1, dtype=dtype)
    w = _randn(n, k, seed=n + 1, dtype=dtype, scale=k ** -0.5)
    with torch_threads(1):
        full = invariant_linear(x, w)
        bad = [m for m in (1, 2, 5, 15, 16, 17, 31, 33, 48, 100, 128, 255, 257, 299)
               if not _same(invariant_linear(x[:m], w), full[:m])]
        bad += [f"rows {a}:{b}" for a, b in ((1, 2), (17, 49), (150, 300)) if not _same(invariant_linear(x[a:b], w), full[a:b])]
    assert bad == [], f"K={k} N={n} {dtype}: rows differ for M in {bad} on {host_cpu()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("m,k,n", [(300, 8192, 1040), (2048, 1552, 2064), (16384, 8192, 136)])
def test_the_thread_count_does_not_change_a_bit(dtype, m, k, n):
    """Training ranks run one thread each under torchrun, a rollout process or a host with many cores
    several: 1, 2, 4 and 8 threads (oversubscribed on a small machine) give the same bits."""
    x = _randn(m, k, seed=m, dtype=dtype)
    w = _randn(n, k, seed=k, dtype=dtype, scale=k ** -0.5)
    results = {}
    for threads in (1, 2, 4, 8):
        with torch_threads(threads):
            results[threads] = invariant_linear(x, w)
    bad = [t for t in (2, 4, 8) if not _same(results[t], results[1])]
    assert bad == [], f"M={m} K={k} N={n} {dtype}: {bad} threads differ from 1 on {host_cpu()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("m,k,n", [(77, 1536, 1040), (300, 4096, 208), (16384, 8192, 136)])
def test_row_parallel_leaves_do_not_depend_on_the_rank_rows_or_threads(dtype, m, k, n):
    """A row-parallel layer's C canonical leaves (K/C each): a rank holding C/TP of them computes the
    same leaf products as one device holding all C, whatever M and the thread count."""
    leaves = 8
    x = _randn(m, k, seed=3, dtype=dtype)
    w = _randn(n, k, seed=4, dtype=dtype, scale=k ** -0.5)
    with torch_threads(1):
        full = leaf_partials(x, w, leaves)
    bad = []
    for tp in (2, 4, 8):
        part = k // tp
        for r in range(tp):
            with torch_threads(1):
                got = leaf_partials(x[:, r * part:(r + 1) * part], w[:, r * part:(r + 1) * part], leaves // tp)
            if not _same(got, full[r * leaves // tp:(r + 1) * leaves // tp]):
                bad.append(f"tp{tp} rank {r}")
    for rows in (1, 17, m // 2):
        with torch_threads(1):
            if not _same(leaf_partials(x[:rows], w, leaves), full[:, :rows]):
                bad.append(f"M={rows}")
    for threads in (2, 4, 8):
        with torch_threads(threads):
            if not _same(leaf_partials(x, w, leaves), full):
                bad.append(f"{threads} threads")
    assert bad == [], f"M={m} K={k} N={n} {dtype}: {bad} on {host_cpu()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_products_in_shared_tiles_are_each_products_own_bits(dtype):
    """A MoE layer's expert fc1 GEMMs computed together (``invariant_linear_values``: weights side by side
    in a column tile, their rows stacked in row tiles) give each product's own ``invariant_linear`` bits,
    whatever the rows per product (none, a tile's worth and more), the widths and the thread count; a
    weight wider than a column tile runs alone. The same calls as one product's (the spy test below)."""
    from mindspeed_tp.kernels.linear import invariant_linear_values

    k = 1552
    counts = [3, 0, 128, 45, 200, 1, 64, 129, 17, 9]
    widths = [128, 128, 96, 200, 128, 400, 7, 128, 384, 50]
    xs = [_randn(c, k, seed=i, dtype=dtype) for i, c in enumerate(counts)]
    ws = [_randn(n, k, seed=20 + i, dtype=dtype, scale=k ** -0.5) for i, n in enumerate(widths)]
    with torch_threads(1):
        want = [invariant_linear(x, w) for x, w in zip(xs, ws)]
    bad = []
    for threads in (1, 3):
        with torch_threads(threads):
            got = invariant_linear_values(xs, ws)
        bad += [(threads, i) for i, (g, w) in enumerate(zip(got, want)) if g.shape != w.shape or not _same(g, w)]
    with torch_threads(1):
        fp32 = invariant_linear_values(xs, ws, out_dtype=torch.float32)
    bad += [("fp32 out", i) for i, (x, w) in enumerate(zip(xs, ws))
            if not _same(fp32[i], invariant_linear(x, w, out_dtype=torch.float32))]
    assert bad == [], f"{dtype}: products (threads, index) differ from their own GEMM: {bad} on {host_cpu()}"


def test_a_transposed_operand_is_copied_in_blocks_to_the_same_values():
    """The row-major copy of a transposed right operand (a row-parallel leaf's weight columns), made in
    blocks of source rows when large, holds the values of a plain copy."""
    w = _randn(1200, 3000, seed=5, dtype=torch.float32)
    view = w[:, 1000:2000].t()  # (1000, 1200), row stride 1
    got = torch_backend._whole(view)
    assert got.is_contiguous() and got.data_ptr() % 64 == 0 and torch.equal(got, view.contiguous())


def test_every_library_call_is_one_shape_in_one_thread(monkeypatch):
    """What the construction promises: every library call a linear or a matmul makes is (ROW_TILE, K)
    times (K, COLUMN_TILE) -- or (K, N) for a matmul's fixed N -- on aligned operands, in a thread that
    has one intra-op thread, whatever M, N and the caller's thread count."""
    calls = []
    real = torch.mm

    def spy(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape), torch.get_num_threads(),
                      a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0, a.is_contiguous()))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch_backend.torch, "mm", spy)
    caller_threads = torch.get_num_threads()
    tile = (torch_backend.ROW_TILE, 96)
    for threads in (1, 3):
        with torch_threads(threads):
            for m, n in ((5, 7), (130, 128), (1, 200), (300, 1000)):
                calls.clear()
                x = _randn(m + 1, 96, seed=m, dtype=torch.float32)[1:]  # a view off the alignment
                out = torch_backend.linear(x, _randn(n, 96, seed=n, dtype=torch.float32), torch.float32, 16)
                assert out.shape == (m, n)
                tiles = -(-m // torch_backend.ROW_TILE) * -(-n // torch_backend.COLUMN_TILE)
                assert calls == [(tile, (96, torch_backend.COLUMN_TILE), 1, True, True)] * tiles, (m, n, calls[:3])
            calls.clear()  # products in shared tiles: widths 100 + 200 + 50 in one column tile, 136 rows in two
            xs = [_randn(m + 1, 96, seed=m, dtype=torch.float32)[1:] for m in (5, 130, 1)]
            outs = torch_backend.grouped_linear(xs, [_randn(n, 96, seed=n, dtype=torch.float32) for n in (100, 200, 50)],
                                                torch.float32, 16)
            assert [o.shape for o in outs] == [(5, 100), (130, 200), (1, 50)]
            assert calls == [(tile, (96, torch_backend.COLUMN_TILE), 1, True, True)] * 2, calls
            calls.clear()
            torch_backend.matmul(_randn(3, 200, 64, seed=1, dtype=torch.float32),
                                 _randn(3, 64, 40, seed=2, dtype=torch.float32), 16)
            assert calls == [((torch_backend.ROW_TILE, 64), (64, 40), 1, True, True)] * 6, calls
    assert torch.get_num_threads() == caller_threads  # the workers' one thread never reached the caller


def test_the_librarys_own_gemm_is_not_row_invariant_on_this_host():
    """The premise of the sweep below: the sweep's first shape reaches a switch of the host's library --
    a plain fp32 GEMM of a few rows gives other bits than the same rows computed among 512 (MKL's
    small-M path), so a construction that passes the sweep is not passing by luck."""
    k, n = 1040, 136
    x = _randn(512, k, seed=1, dtype=torch.float32)
    w = _randn(n, k, seed=2, dtype=torch.float32, scale=k ** -0.5)
    with torch_threads(2):
        full = x @ w.t()
        differ = [m for m in range(1, 65) if not _same(x[:m] @ w.t(), full[:m])]
    assert differ, f"the library's fp32 GEMM is row-invariant at K={k} N={n} on {host_cpu()}"


def _isa_cases():
    """No limit (the host's own ISA) and every oneDNN / MKL limit below it that the host can run."""
    levels = cpu_isa.isa_levels()
    return [None] + levels[:-1]


@pytest.mark.parametrize("limit", _isa_cases(), ids=lambda c: "host-isa" if c is None else c[0])
def test_the_sweep_passes_under_every_isa_this_host_can_emulate(limit, tmp_path):
    """tests/workers/gemm_sweep.py in a fresh process (the libraries read their ISA limit once): every
    M from 1 to 512, K to 8192, column tails, 1/2/4/8 threads, fp32 and bf16, forward, dx and dW."""
    env = _env()  # the checkout's package first (a venv may also hold an installed copy)
    for var in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(var, None)
    if limit is not None:
        env["ONEDNN_MAX_CPU_ISA"], env["MKL_ENABLE_INSTRUCTIONS"] = limit
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "workers", "gemm_sweep.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    where = f"{host_cpu()}; ISA limit {limit[0] + ' / MKL ' + limit[1] if limit else 'none (the host ISA)'}"
    assert report["cases"] > 1000, report
    assert report["bad"] == [], f"{len(report['bad'])} of {report['cases']} cases differ on {where}: {report['bad'][:12]}"


_CLI = {}


def _check(name, *args):
    """One checker launch per case, shared by the tests that read it."""
    if name not in _CLI:
        proc = run_cli("check", *args)
        assert proc.returncode == 0, explain(proc)
        _CLI[name] = proc.stdout
    return _CLI[name]


def test_non_power_of_two_hidden_and_ffn_are_bitwise_in_fp32():
    """hidden 192, FFN 600 (fc1 shards of 600 columns at TP=2: not a multiple of the tile; SwiGLU on
    rows of 300, not a multiple of any CPU vector loop's step), fp32, where the host BLAS's kernel
    choice by N and ATen's elementwise tails showed first: every layout's logprobs are the reference
    engine's (decode rows of one token); vanilla megatron-core differs."""
    out = _check("odd", "--model", "tiny-dense-odd", "--layouts", "tp1,tp2,tp2-sp-pp2", "--dtype", "fp32",
                 "--rollout", "4", "--compare-vanilla")
    rows = {tuple(line.split()[:2]): line for line in out.splitlines() if line.startswith("tp")}
    for layout in ("tp1", "tp2", "tp2-sp-pp2"):
        assert "100.0%" in rows[(layout, "mindspeed-tp")], (host_cpu(), out)
    assert "100.0%" not in rows[("tp2", "vanilla")], out
    assert "RESULT: bitwise equal to the rollout engine's logprobs" in out


def test_shared_experts_in_decode_match_the_rollout_engine():
    """A shared-expert MoE (tiny-moe-shared) scored against the reference engine's rollouts: 48 sampled
    tokens each (decode rows of one token) at TP=1 and in TP/SP/EP/PP layouts, bf16."""
    out = _check("shared", "--model", "tiny-moe-shared", "--rollout", "3", "--max-new-tokens", "48",
                 "--temperature", "1.0", "--dtype", "bf16", "--layouts", "tp1,tp2-sp-ep2,tp2-sp-pp2")
    rows = [line for line in out.splitlines() if line.startswith("tp")]
    assert len(rows) == 3 and all("100.0%" in r and " 144 " in r for r in rows), (host_cpu(), out)
    assert "RESULT: bitwise equal to the rollout engine's logprobs" in out


def test_a_row_multiple_that_does_not_divide_the_row_tile_is_refused_by_name():
    """gemm_row_multiple is honoured by the row tile (a whole number of the profile's multiples) or
    refused, naming the profile field; and the primitives are forward-only (no silent autograd)."""
    x = _randn(5, 32, seed=1, dtype=torch.float32)
    w = _randn(8, 32, seed=2, dtype=torch.float32)
    for kernel, args in ((torch_backend.linear, (x, w, torch.float32)), (torch_backend.matmul, (x, w.t()))):
        with pytest.raises(ValueError, match="gemm_row_multiple'=48 must divide"):
            kernel(*args, 48)
        assert _same(kernel(*args, 32), kernel(*args, 16))
    # empty products (an expert that received no token): the shapes, no library call
    assert torch_backend.matmul(_randn(3, 0, 8, seed=3, dtype=torch.float32), w[:, :8].t().expand(3, 8, 8)).shape == (3, 0, 8)
    assert torch_backend.linear(x[:0], w, torch.float32, 16).shape == (0, 8)
    with pytest.raises(RuntimeError, match="forward-only.*with_plain_backward"):
        torch_backend.linear(x.requires_grad_(True), w, torch.float32, 16)
