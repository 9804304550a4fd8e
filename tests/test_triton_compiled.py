"""The triton backend's GPU code, checked on a CPU: every kernel compiled ahead of time for sm_90 and
sm_80 (Triton's whole pipeline down to the cubin, with the wheel's ptxas) with the arguments its call
sites pass (scripts/compile_triton_kernels.py records them from the real wrappers), at CI's Triton and
at the GPU machines' (3.6: scripts/setup_env.sh installs it beside the venv's, ``TRITON_36``).

What it proves: each numerics (kernel, dtype, head dim, tiles) compiles to one binary whatever the
call site (training with or without megatron's causal mask, key padding, chunked prefill, paged
decode, packed sequences, CP, any GQA ratio, aligned or copied operands, the backward's three passes,
and users' dimensions: Qwen3-8B / 30B-A3B at 32k tokens, an LM head over 151936 columns at 64k tokens
whose strides pass 2**31), so a layout or a mode can never pick another summation order; no kernel
spills registers (stack 0 in the cubin's resource usage); and every product of a bf16 GEMM and of the
attention forward and backward is a tensor-core MMA (the TTGIR's dots in an MMA encoding, HGMMA on
sm_90 / HMMA on sm_80 in the SASS). What it does not: that the kernels run, how fast, or what their
bits are (a GPU: scripts/device_check.sh)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "compile_triton_kernels.py")
# Where scripts/setup_env.sh installs Triton 3.6 (the GPU machines' version) beside the venv's own.
TRITON_36 = os.path.join(sys.prefix, "triton-3.6")
KERNELS = {"gemm_kernel", "row_sum_kernel", "softmax_kernel", "attention_kernel", "attention_delta_kernel",
           "attention_dkdv_kernel", "attention_dq_kernel"}


def _compile(tmp_path, extra_path=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile here, not from an earlier run's cache
    # the checkout's package, not a venv's copy; a Triton ahead of the venv's where asked
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset; the kernels pin it at launch
    table = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, SCRIPT, "--arch", "90", "80", "--tests", "--table", str(table)], env=env,
                          capture_output=True, text=True, timeout=1200)
    return proc, table


@pytest.mark.parametrize("version", ["ci", "3.6"])
def test_one_compiled_variant_per_numerics_no_spills_and_tensor_core_products(tmp_path, version):
    extra = None
    if version == "3.6":
        assert os.path.isdir(os.path.join(TRITON_36, "triton")), (
            f"Triton 3.6 is not installed at {TRITON_36}: run scripts/setup_env.sh (it installs the GPU machines' "
            f"Triton there to compile against)")
        extra = TRITON_36
    proc, table = _compile(tmp_path, extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "one variant per numerics, no spills" in proc.stdout, out
    if version == "3.6":
        assert proc.stdout.startswith("triton 3.6."), out[:300]
    rows = table.read_text().splitlines()[2:]
    assert len(rows) > 40, table.read_text()
    for arch, mma in ((90, "HGMMA"), (80, "HMMA")):
        section = proc.stdout.split(f"sm_{arch}, ")[1].split("\ntriton ")[0]
        lines = [l for l in section.splitlines() if l.startswith("  ")]
        assert all(" STACK 0 " in l for l in lines), section
        assert {re.match(r"  (\w+)", l).group(1) for l in lines} == KERNELS, section
        attention = [l for l in lines if l.startswith("  attention_kernel")]
        # Each supported head dim in bf16 and fp32 at the profiles' 128-key blocks is one binary for
        # every call site (training with / without the mask, padding, prefill, decode, the backward's
        # forward, ...); the head dim 128 also at the users' dimensions.
        for d in (32, 64, 96, 128):
            for vec in (8, 4):  # bf16, fp32
                ours = [l for l in attention if f" D={d} " in l and f" VEC={vec} " in l and "BLOCK_KEYS=128" in l]
                assert len(ours) == 1, attention
                real = d == 128 and vec == 8  # the users' dimensions are bf16
                assert int(re.search(r"; (\d+) sites\)", ours[0]).group(1)) >= (16 if real else 12), ours[0]
        # bf16: every product of the GEMM and of attention's forward and backward on tensor cores
        for kernel in ("gemm_kernel", "attention_kernel", "attention_dkdv_kernel", "attention_dq_kernel"):
            bf16 = "a_ptr:*bf16" if kernel == "gemm_kernel" else "q_ptr:*bf16"
            half = [l for l in lines if l.startswith(f"  {kernel} ") and bf16 in l]
            assert half, (kernel, section)
            for line in half:
                done, total = map(int, re.search(r" dots (\d+)/(\d+) on tensor cores", line).groups())
                assert total >= 1 and done == total and int(re.search(rf" {mma} (\d+) ", line).group(1)) > 0, line
