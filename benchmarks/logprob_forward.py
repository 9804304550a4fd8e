"""Time of a logprob forward pass, mindspeed-tp vs vanilla megatron-core, same layout, same run.

    torchrun --standalone --nproc-per-node 8 benchmarks/logprob_forward.py --layout tp4-sp-pp2

Prints the median of --repeats timed passes per mode (after one warm-up) and the ratio
consistent/vanilla. Speed is reported here, never asserted in tests.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import mindspeed_tp
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.batch import make_batch
from mindspeed_tp.check.harness import _logprobs_from_logits, _pipeline_forward, _setup_parallel_state, init_distributed
from mindspeed_tp.check.builder import DTYPES, build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import load_seeded_weights
from mindspeed_tp.contract.profile import load_profile


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-dense")
    p.add_argument("--layout", default="tp4-sp-pp2")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    owns_group = not dist.is_initialized()  # a caller's process group (tests/workers/bench_smoke.py) stays
    init_distributed()
    install_cpu_shims()
    from megatron.core import parallel_state

    spec, profile, layout = load_model_spec(args.model), load_profile(), Layout.parse(args.layout)
    batch = make_batch(spec.vocab_size, 0, args.batch_size, args.seq_length)
    dtype = DTYPES[args.dtype]
    times = {}
    for mode in ("vanilla", "consistent", "vanilla", "consistent"):  # interleaved against drift
        mindspeed_tp.disable() if mode == "vanilla" else mindspeed_tp.enable(profile)
        _setup_parallel_state(layout, 0)
        model = build_gpt_stage(spec, layout, dtype, profile)
        load_seeded_weights(model, spec, 0, layout)
        for i in range(args.repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = _pipeline_forward(model, layout, batch, spec.hidden_size, dtype)
                if out is not None:
                    _logprobs_from_logits(out, batch, spec.vocab_size)
            dist.barrier()
            if i:
                times.setdefault(mode, []).append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        v, c = statistics.median(times["vanilla"]), statistics.median(times["consistent"])
        print(f"model={spec.name} layout={layout.name} dtype={args.dtype} tokens={args.batch_size * args.seq_length} "
              f"world={dist.get_world_size()}")
        print(f"vanilla    median {v * 1e3:8.1f} ms")
        print(f"consistent median {c * 1e3:8.1f} ms")
        print(f"ratio consistent/vanilla: {c / v:.2f}x")
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
