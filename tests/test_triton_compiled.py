"""The triton backend's GPU code, checked on a CPU: every kernel compiled ahead of time for sm_90 and
sm_80 (Triton's whole pipeline down to the cubin, with the wheel's ptxas) with the arguments its call
sites pass (scripts/compile_triton_kernels.py records them from the real wrappers).

What it proves: each numerics (kernel, dtype, head dim, tiles) compiles to one binary whatever the
call site (training with or without megatron's causal mask, key padding, chunked prefill, paged
decode, packed sequences, CP, any GQA ratio, aligned or copied operands), so a layout or a mode can
never pick another summation order; and no kernel spills registers (stack 0 in the cubin's resource
usage). What it does not: that the kernels run or what their bits are (a GPU:
scripts/device_check.sh)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "compile_triton_kernels.py")


def test_one_compiled_variant_per_numerics_and_no_register_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile here, not from an earlier run's cache
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])  # the checkout's package, not a venv's copy
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset; the kernels pin it at launch
    proc = subprocess.run([sys.executable, SCRIPT, "--arch", "90", "80", "--tests"], env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "one variant per numerics, no spills" in proc.stdout, out
    for arch in (90, 80):
        section = proc.stdout.split(f"sm_{arch}, ")[1].split("\ntriton ")[0]
        lines = [l for l in section.splitlines() if l.startswith("  ")]
        assert all(" STACK 0 (" in l for l in lines), section
        attention = [l for l in lines if l.startswith("  attention_kernel")]
        # The bundled head dims in bf16 and fp32 at the profiles' 128-key blocks, each one binary
        # for all nine call sites (training with/without the mask, padding, prefill, decode, ...).
        for d in (32, 64, 128):
            for vec in (8, 4):  # bf16, fp32
                ours = [l for l in attention if f" D={d} " in l and f" VEC={vec} " in l and "BLOCK_KEYS=128" in l]
                assert len(ours) == 1 and "; 9 sites)" in ours[0], attention
        kernels = {re.match(r"  (\w+)", l).group(1) for l in lines}
        assert kernels == {"gemm_kernel", "row_sum_kernel", "softmax_kernel", "attention_kernel"}, section
