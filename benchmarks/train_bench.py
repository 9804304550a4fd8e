"""Step time and peak memory of bitwise training vs vanilla megatron-core (CPU, gloo).

    python benchmarks/train_bench.py [--model bench-dense-1024] [--layouts tp2-sp,tp2-sp-dp2]
                                     [--steps 3] [--seq-length 128] [--dtype bf16] [--json PATH] [--smoke]

One torchrun launch per (layout, mode) -- vanilla, mindspeed-tp (default profile), mindspeed-tp with
bitwise_training (and at DP=1 with microbatch_groups: 1) -- through the train-check's own training script (megatron's DDP with the
distributed optimizer, the schedules, finalize_model_grads, Adam with clipping) without its
comparisons. Step time: the mean of steps 2..K (max over ranks); peak memory: the largest rank's
peak RSS growth from just before the model is built. Prints both and their ratios to vanilla (and
writes them with ``--json PATH``); no pass/fail (speed is not a test).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("vanilla", "mindspeed-tp", "bitwise")
# The cheaper order the contract allows at DP=1: one micro-batch group (no extra fp32 gradient
# buffer), which fixes the job to DP=1 layouts.
DP1_MODES = ("bitwise-g1",)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker(ns) -> None:
    from functools import partial

    import torch
    import torch.distributed as dist

    from mindspeed_tp import disable, enable
    from mindspeed_tp.check.harness import _setup_parallel_state, init_distributed
    from mindspeed_tp.check.builder import DTYPES
    from mindspeed_tp.models.layout import Layout
    from mindspeed_tp.models.spec import load_model_spec
    from mindspeed_tp.check.train.loop import (TrainSettings, _data, _forward_step, _LossRecorder, model_parallel_chunks,
                                               make_optimizer, wire_config, micro_batch_rows, train_batch)
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.devices.cpu_shims import install_cpu_shims

    init_distributed(1800.0)
    install_cpu_shims()
    spec, layout = load_model_spec(ns.model), Layout.parse(ns.layout)
    profile = load_profile("default").replace(bitwise_training=ns.mode.startswith("bitwise"),
                                              microbatch_groups=1 if ns.mode == "bitwise-g1" else 2)
    settings = TrainSettings(steps=ns.steps, micro_batch_size=1, global_batch_size=ns.global_batch_size,
                             seq_length=ns.seq_length, distributed_optimizer=True)
    disable() if ns.mode == "vanilla" else enable(profile)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _setup_parallel_state(layout, settings.seed, training=True)
    base = _rss_mb()
    chunks, wrapped, ddp_config = model_parallel_chunks(spec, layout, DTYPES[ns.dtype], profile, settings)
    optimizer = make_optimizer(wrapped, DTYPES[ns.dtype], settings)
    wire_config(chunks[0].config, wrapped, ddp_config, optimizer)
    batch = train_batch(spec, settings)
    rows = micro_batch_rows(settings, layout.dp, ps.get_data_parallel_rank())
    times = []
    for _ in range(settings.steps):
        for m in wrapped:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        start = time.perf_counter()
        get_forward_backward_func()(
            forward_step_func=partial(_forward_step, _LossRecorder(settings.seq_length)), data_iterator=_data(batch, rows),
            model=wrapped[0], num_microbatches=len(rows), seq_length=settings.seq_length, micro_batch_size=1,
            decoder_seq_length=settings.seq_length, forward_only=False)
        optimizer.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    out = torch.tensor([sum(times[1:]) / max(1, len(times) - 1), peak], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(ns.out, "w") as f:
            json.dump({"step_s": float(out[0]), "peak_mb": float(out[1])}, f)
    dist.destroy_process_group()


# --smoke: the tiny model at TP=1, bitwise training only (one launch: the suite's time; vanilla differs
# from it only by not enabling).
SMOKE = dict(model="tiny-dense", layouts="tp1", steps=2, seq_length=16, global_batch_size=2)
SMOKE_MODES = ("bitwise",)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-dense-1024")
    p.add_argument("--layouts", default="tp2-sp,tp2-sp-dp2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--json", help="also write the rows (and the settings) as JSON to this path")
    p.add_argument("--smoke", action="store_true", help="the tiny model at tp1, bitwise training, two short steps (the tests run it)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.smoke:
        for key, value in SMOKE.items():
            setattr(ns, key, value)
    if ns.worker:
        return worker(ns)
    from mindspeed_tp.models.layout import Layout

    print(f"model={ns.model} dtype={ns.dtype} seq={ns.seq_length} global-batch={ns.global_batch_size} "
          f"micro-batch=1 steps={ns.steps} distributed optimizer")
    print(f"{'layout':<14}{'mode':<14}{'step s':>9}{'peak MB':>10}{'time x':>8}{'mem x':>8}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    for name in ns.layouts.split(","):
        layout = Layout.parse(name)
        world = layout.world_size
        base = None
        for mode in SMOKE_MODES if ns.smoke else MODES + (DP1_MODES if layout.dp == 1 else ()):
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                       os.path.abspath(__file__), "--worker", "--layout", name, "--mode", mode, "--out", tmp.name,
                       "--model", ns.model, "--steps", str(ns.steps), "--seq-length", str(ns.seq_length),
                       "--global-batch-size", str(ns.global_batch_size), "--dtype", ns.dtype]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"{name} {mode} failed:\n{proc.stderr[-3000:]}")
                with open(tmp.name) as f:
                    r = json.load(f)
            base = base or r
            rows.append({"layout": name, "mode": mode, "step_s": r["step_s"], "peak_mb": r["peak_mb"],
                         "step_x_vanilla": r["step_s"] / base["step_s"], "peak_x_vanilla": r["peak_mb"] / base["peak_mb"]})
            print(f"{name:<14}{mode:<14}{r['step_s']:>9.2f}{r['peak_mb']:>10.0f}{r['step_s'] / base['step_s']:>8.2f}"
                  f"{r['peak_mb'] / base['peak_mb']:>8.2f}", flush=True)
    if ns.json:
        from mindspeed_tp.check.report import write_json_atomic

        write_json_atomic(ns.json, {"model": ns.model, "dtype": ns.dtype, "seq_length": ns.seq_length,
                                    "global_batch_size": ns.global_batch_size, "steps": ns.steps,
                                    "micro_batch_size": 1, "distributed_optimizer": True, "rows": rows})


if __name__ == "__main__":
    main()
