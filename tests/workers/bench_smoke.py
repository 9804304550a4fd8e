"""The torchrun benchmarks in one launch (tests/test_benchmarks.py): each script imported from
benchmarks/ and its main() run on a tiny case in this process group, so that a moved module or a
changed helper breaks the suite, not the benchmark. Usage: bench_smoke.py OUT_DIR (2 ranks).
The GEMM part of gpu_bench runs on rank 0 under Triton's interpreter (TRITON_INTERPRET=1 in the
launch's environment)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch.distributed as dist  # noqa: E402

from mindspeed_tp.check.driver import init_distributed  # noqa: E402
from worker_exit import finish_worker  # noqa: E402

import gpu_bench  # noqa: E402
import module_shares  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    init_distributed()
    tiny = ["--model", "tiny-dense", "--layout", "tp2-sp", "--dtype", "fp32", "--batch-size", "1",
            "--seq-length", "32", "--repeats", "1"]
    module_shares.main(tiny)
    print("BENCH-SMOKE module_shares done", flush=True)
    gpu_bench.main(["model", "--device", "cpu", *tiny, "--profile", "--json", os.path.join(out, "gpu_model.json")])
    print("BENCH-SMOKE gpu_bench model done", flush=True)
    if dist.get_rank() == 0:
        gpu_bench.main(["gemm", "--device", "cpu", "--model", "tiny-dense", "--tokens", "16", "--warmup", "0",
                        "--iters", "1", "--json", os.path.join(out, "gpu_gemm.json")])
        print("BENCH-SMOKE gpu_bench gemm done", flush=True)
    finish_worker()


if __name__ == "__main__":
    main()
