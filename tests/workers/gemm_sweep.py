"""The GEMM-invariance sweep in a fresh process, so that the ISA limits the CPU libraries read once at
start (``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, set by the caller) apply to every call.

Usage: python gemm_sweep.py OUT.json [quick]. Writes {"cases": N, "bad": [...], "isa": ...}: each bad
entry names the dtype, the GEMM (forward, dx, dW), the case and what differed.

What it reaches: every M from 1 to 512 against M = 512 (the row counts at which MKL and oneDNN change
kernels: small-M paths, AMX past 17-33 rows), K from 24 to 8192 with non-powers of two, column tails
(N mod 128 from 8 to 120), column shards starting at every offset 1-24 (a column at every position of
a library's micro-kernel panel), rows shifted within a row tile, threads 1, 2, 4 and 8 against 1, fp32 and
bf16, the gradient GEMMs of bitwise training (dx over the tokens, dW of a rank's column shard), and
many small products in shared tiles (``invariant_linear_values``: a MoE layer's experts) against one call each.
"""
import json
import os
import sys

import torch

from mindspeed_tp.kernels import invariant_linear
from mindspeed_tp.kernels.linear import invariant_input_grad, invariant_linear_values, invariant_weight_grad

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _randn(*shape, seed, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(BITS[a.dtype]),
                                                                      b.contiguous().view(BITS[b.dtype]))


def _threads(n):
    torch.set_num_threads(n)
    return n


def sweep(quick: bool):
    bad, cases = [], 0
    every_m = range(1, 513) if not quick else list(range(1, 66)) + list(range(66, 513, 7))
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[1]
        # every M against M = 512, one thread: K and N of a real projection's shard (a column tail of 8)
        _threads(1)
        k, n = 1040, 136
        x = _randn(512, k, seed=1, dtype=dtype)
        w = _randn(n, k, seed=2, dtype=dtype, scale=k ** -0.5)
        full = invariant_linear(x, w)
        for m in every_m:
            cases += 1
            if not _same(invariant_linear(x[:m], w), full[:m]):
                bad.append(f"{name} forward K={k} N={n}: rows of M={m} differ from M=512")
        # K up to 8192 (powers of two and not) with column tails, a few M that cross the tile edges
        for k, n in ((24, 8), (200, 1000), (576, 260), (3088, 4100), (4096, 1552), (8192, 136)):
            x = _randn(260, k, seed=k, dtype=dtype)
            w = _randn(n, k, seed=n, dtype=dtype, scale=k ** -0.5)
            full = invariant_linear(x, w)
            for m in (1, 17, 33, 127, 128, 129, 257):
                cases += 1
                if not _same(invariant_linear(x[:m], w), full[:m]):
                    bad.append(f"{name} forward K={k} N={n}: rows of M={m} differ from M=260")
            # shards from every offset of a micro-kernel panel (panels 8 to 128 wide: a column at every
            # position of a library's panel), to the end of N, and mid-N
            shards = [(start, n - start) for start in range(1, 25) if start < n]
            for start, width in shards + [(0, n // 2), (n - n // 4, n // 4), (8, 120)]:
                cases += 1
                if width and not _same(invariant_linear(x, w[start:start + width]), full[:, start:start + width]):
                    bad.append(f"{name} forward K={k} N={n}: columns {start}:{start + width} differ from the full N")
            # the same rows at other positions within a row tile (a decode step's row 0 is a prefill's row t)
            for shift in (1, 3, 5, 6, 7):
                cases += 1
                shifted = torch.cat([_randn(shift, k, seed=shift, dtype=dtype), x])
                if not _same(invariant_linear(shifted, w)[shift:], full):
                    bad.append(f"{name} forward K={k} N={n}: rows shifted by {shift} differ")
        # threads 2, 4, 8 against 1: forward and both gradient GEMMs
        m, k, n = 300, 3088, 1040
        x = _randn(m, k, seed=5, dtype=dtype)
        w = _randn(n, k, seed=6, dtype=dtype, scale=k ** -0.5)
        dy = _randn(m, n, seed=7, dtype=dtype)
        results = {}
        for t in (1, 2, 4, 8):
            _threads(t)
            results[t] = (invariant_linear(x, w), invariant_input_grad(dy, w, dtype, 16),
                          invariant_weight_grad(dy, x, dtype, 16))
        for t in (2, 4, 8):
            for gemm, got, want in zip(("forward", "dx", "dW"), results[t], results[1]):
                cases += 1
                if not _same(got, want):
                    bad.append(f"{name} {gemm} M={m} K={k} N={n}: {t} threads differ from 1")
        # the gradient GEMMs: dx of M tokens against all 300, dW of a rank's columns against the full dW
        _threads(2)
        dx, dw = results[1][1], results[1][2]
        for rows in (1, 33, 129):
            cases += 1
            if not _same(invariant_input_grad(dy[:rows], w, dtype, 16), dx[:rows]):
                bad.append(f"{name} dx: rows of M={rows} differ from M={m}")
        for tp in (2, 4, 8):
            width = k // tp
            for rank in (0, tp - 1):
                cols = slice(rank * width, (rank + 1) * width)
                cases += 1
                if not _same(invariant_weight_grad(dy, x[:, cols].contiguous(), dtype, 16), dw[:, cols]):
                    bad.append(f"{name} dW: TP={tp} rank {rank}'s columns differ from the full dW")
        # many small products in shared tiles (a MoE layer's experts, ``grouped_linear``) against one
        # ``linear`` each: rows and columns at other positions of a tile, a product past a tile's rows
        for k, n in ((1040, 128), (3088, 96), (576, 200)):
            counts = [0, 1, 33, 17, 129, 200, 5, 64, 31, 2]
            xs = [_randn(c, k, seed=10 + i, dtype=dtype) for i, c in enumerate(counts)]
            ws = [_randn(n, k, seed=40 + i, dtype=dtype, scale=k ** -0.5) for i in range(len(counts))]
            for t in (1, 2):
                _threads(t)
                got = invariant_linear_values(xs, ws)
                for i, (x, w) in enumerate(zip(xs, ws)):
                    cases += 1
                    if not _same(got[i], invariant_linear(x, w)):
                        bad.append(f"{name} grouped K={k} N={n}: product {i} ({counts[i]} rows, {t} threads) differs")
    return cases, bad


def main():
    out, quick = sys.argv[1], "quick" in sys.argv[2:]
    cases, bad = sweep(quick)
    isa = {v: os.environ.get(v, "") for v in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    with open(out, "w") as f:
        json.dump({"cases": cases, "bad": bad, "isa": isa}, f)


if __name__ == "__main__":
    main()
