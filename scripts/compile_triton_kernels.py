"""Compile the triton backend's kernels ahead of time for a CUDA architecture -- no GPU needed.

    python scripts/compile_triton_kernels.py [--arch 90] [--quick]

Runs Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the wheel's ptxas) for the
configurations the backend launches: the GEMM tiles of both dtypes with and without bias, the row
kernels, and attention at head dim 128 with 128-key blocks (bf16, with and without a split size) and
head dim 64 in fp32 (``--quick``: attention at head dim 16 and 16-key blocks, as the tests use). It
shows the kernels compile with this Triton for that target (and whether the GEMM uses wgmma), not
that they run or what their bits are: that is scripts/device_check.sh's job on a GPU.
"""
import argparse
import importlib.util
import os
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "..", "mindspeed_tp", "kernels", "backends", "triton_kernels.py")
I32 = "i32"
_ATTN_INTS = (["sq", "hq", "group", "block", "per_split", "page_size", "ex_width"]
              + [f"s_{p}{q}" for p, qs in (("q", "bhsd"), ("k", "pohd"), ("v", "pohd"), ("o", "bhsd")) for q in qs]
              + ["s_pb", "s_ps", "s_tb", "s_tp", "s_eb", "s_eq", "s_ek"])


def load_kernels():
    """triton_kernels.py on its own (no torch needed), compiled-mode kernels."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile")
    spec = importlib.util.spec_from_file_location("triton_kernels", KERNELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Arguments a launch with 16-byte aligned tensors and sizes that are multiples of 16 specialises as
# divisible by 16 (what lets Triton use cp.async pipelining): every pointer, and these sizes.
_DIVISIBLE = ("K", "stride_am", "stride_bn", "stride_bb", "stride_cm", "s_qs", "s_ko", "s_vo", "s_os")


def compile_one(fn, types, consts, warps, stages, target):
    signature = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (types[n].startswith("*") or n in _DIVISIBLE)}
    t0 = time.perf_counter()
    out = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs), target=target,
                         options={"num_warps": warps, "num_stages": stages})
    ptx = out.asm["ptx"]
    return {"kernel": fn.__name__, "seconds": round(time.perf_counter() - t0, 1), "shared_bytes": out.metadata.shared,
            "wgmma": "wgmma" in ptx, "cp_async": "cp.async" in ptx, "local_memory": ".local" in ptx}


def jobs(k, quick):
    for dtype, tiles in (("bf16", k.GEMM_TILES_HALF), ("fp32", k.GEMM_TILES_FP32)):
        bm, bn, bk, group, warps, stages = tiles
        for bias, out in ((False, "fp32"), (True, "bf16")):
            types = dict(a_ptr="*" + dtype, b_ptr="*" + dtype, bias_ptr="*bf16", c_ptr="*" + out,
                         **{n: I32 for n in ("M", "N", "K", "stride_ab", "stride_am", "stride_ak", "stride_bb",
                                             "stride_bk", "stride_bn", "stride_cb", "stride_cm", "stride_cn")})
            # Unit strides as a launch specialises them (x row-major, b = weight.T, out row-major).
            yield (f"gemm {dtype} bias={bias} out={out}", k.gemm_kernel, types,
                   dict(HAS_BIAS=bias, INTERPRETED=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                        stride_ak=1, stride_bk=1, stride_cn=1), warps, stages)
    for dtype in ("fp32", "bf16"):
        yield (f"row_sum {dtype}", k.row_sum_kernel, dict(x_ptr="*" + dtype, out_ptr="*fp32", N=I32, stride_row=I32),
               dict(BLOCK=k.ROW_BLOCK), k.ROW_WARPS, 1)
    yield ("softmax fp32", k.softmax_kernel, dict(x_ptr="*fp32", out_ptr="*fp32", N=I32, stride_x=I32, stride_out=I32),
           dict(BLOCK=k.ROW_BLOCK), k.ROW_WARPS, 1)
    cases = [("bf16", 16, 16, False)] if quick else [("bf16", 128, 128, False), ("bf16", 128, 128, True),
                                                      ("fp32", 64, 128, False)]
    for dtype, d, keys, split in cases:
        types = dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, o_ptr="*" + dtype, pos_ptr="*i32",
                     seqlen_ptr="*i32", table_ptr="*i32", ex_ptr="*u8", scale="fp32", **{n: I32 for n in _ATTN_INTS})
        yield (f"attention {dtype} d={d} keys={keys} split={split}", k.attention_kernel, types,
               dict(D=d, CAUSAL=True, SPLIT=split, INTERPRETED=False, BLOCK_Q=k.ATTN_BLOCK_Q, BLOCK_KEYS=keys,
                    BLOCK_D=d, s_qd=1, s_kd=1, s_vd=1, s_od=1), k.ATTN_WARPS, k.ATTN_STAGES)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an integer (90: H100/H200)")
    p.add_argument("--quick", action="store_true", help="small attention tiles only (the tests' configuration)")
    args = p.parse_args(argv)
    k = load_kernels()
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    for name, fn, types, consts, warps, stages in jobs(k, args.quick):
        r = compile_one(fn, types, consts, warps, stages, target)
        print(f"{name:<40} compiled in {r['seconds']:5.1f}s  shared {r['shared_bytes']:>7}  wgmma {r['wgmma']!s:<5}  "
              f"cp.async {r['cp_async']!s:<5}  local memory {r['local_memory']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
