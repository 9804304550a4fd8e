"""GPU cost of the contract: the triton backend's invariant GEMM against cuBLAS, and a model's
logprob forward and training step, mindspeed-tp (consistent) against vanilla megatron-core.

    python benchmarks/gpu_bench.py gemm --json gemm.json
    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_bench.py model --layout tp1 --json tp1.json
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_bench.py model --layout tp2 --json tp2.json

``gemm``: TFLOP/s of the invariant GEMMs (``kernels/backends/triton.py``: column GEMMs with one
bf16 cast, the row-parallel layers' C canonical leaves as one batched launch with fp32 output, the
LM head with fp32 logits) and of cuBLAS (torch, bf16 out) for the model's shapes at M tokens.
``model``: median forward (no grad, logprobs of the batch) and step (forward + backward of the
scored logprob loss, no optimizer) time per mode, same layout, same process, interleaved; with
``--profile`` each mode's top kernels by own time in one forward and one step. Two
ranks on one GPU run with host-staged collectives (check/host_staging.py) in both modes, which
inflates both. Ratios only: speed is never asserted in tests. ``--device cpu`` (tiny shapes,
Triton's interpreter for ``gemm``) only checks that the script runs.
"""
import argparse
import json
import os
import statistics
import sys
import time

if __name__ == "__main__":  # run by torchrun: library warnings recorded from the first import of megatron on
    from mindspeed_tp.check import library_warnings

    library_warnings.record_this_run()

import torch  # noqa: E402

from mindspeed_tp.check.library_warnings import add_verbose_flag, report_after_run  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_profile(fn, device, top=12):
    """The ``top`` kernels (or, on CPU, ops) of one call of ``fn`` by their own device time:
    [{name, calls, ms}] from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    names = ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)

    def own_time(event):
        return next((getattr(event, n) for n in names if hasattr(event, n)), 0.0)

    events = sorted(prof.key_averages(), key=own_time, reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, "ms": own_time(e) / 1e3} for e in events if own_time(e) > 0]


def _print_profile(title, rows):
    total = sum(r["ms"] for r in rows)
    print(f"  {title}: top kernels by own time ({total:.1f} ms in these)")
    for r in rows:
        print(f"    {r['ms']:9.2f} ms  {r['calls']:5d}x  {r['name'][:100]}")


def gemm_shapes(spec, tp, canonical_shards):
    """(name, N, K, kind) of the model's GEMMs on one TP rank; kind: column, leaves, head."""
    heads, groups, kv = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    h, ffn = spec.hidden_size, spec.ffn_hidden_size
    return [
        ("qkv", (heads + 2 * groups) * kv // tp, h, "column"),
        ("proj", h, heads * kv // tp, "leaves"),
        ("fc1", 2 * ffn // tp, h, "column"),
        ("fc2", h, ffn // tp, "leaves"),
        ("lm_head", spec.vocab_size // tp, h, "head"),
    ], canonical_shards // tp


def run_gemm(args):
    from mindspeed_tp.models.spec import load_model_spec
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.kernels.backends import triton as tb

    device = torch.device(args.device)
    spec, profile = load_model_spec(args.model), load_profile()
    tb.prepare(profile)  # TF32 off for cuBLAS too: both sides compute what they claim
    dtype = torch.bfloat16
    rows = []
    for tokens in args.tokens:
        shapes, leaves = gemm_shapes(spec, args.tp, profile.canonical_shards)
        for name, n, k, kind in shapes:
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(tokens, k, generator=g).to(device, dtype)
            w = torch.randn(n, k, generator=g).to(device, dtype)
            if kind == "leaves":
                kl = k // leaves
                xs = x.reshape(tokens, leaves, kl).transpose(0, 1)
                ws = w.reshape(n, leaves, kl).permute(1, 2, 0)
                ours = lambda: tb.matmul(xs, ws)  # noqa: E731
                xs_c, ws_c = xs.contiguous(), ws.contiguous()
                theirs = lambda: torch.bmm(xs_c, ws_c)  # noqa: E731
            elif kind == "head":
                ours = lambda: tb.linear(x, w, torch.float32)  # noqa: E731
                theirs = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
            else:
                ours = lambda: tb.linear(x, w, dtype)  # noqa: E731
                theirs = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
            flops = 2.0 * tokens * n * k
            t_ours = _median_time(ours, device, args.warmup, args.iters)
            t_cublas = _median_time(theirs, device, args.warmup, args.iters)
            rows.append({"gemm": name, "kind": kind, "M": tokens, "N": n, "K": k,
                         "leaves": leaves if kind == "leaves" else 1,
                         "invariant_tflops": flops / t_ours / 1e12, "cublas_tflops": flops / t_cublas / 1e12,
                         "invariant_over_cublas": t_cublas / t_ours})
    print(f"{'gemm':<9}{'M':>7}{'N':>7}{'K':>7}{'invariant TF/s':>16}{'cuBLAS TF/s':>13}{'ratio':>8}")
    for r in rows:
        print(f"{r['gemm']:<9}{r['M']:>7}{r['N']:>7}{r['K']:>7}{r['invariant_tflops']:>16.1f}{r['cublas_tflops']:>13.1f}"
              f"{r['invariant_over_cublas']:>8.2f}")
    result = {"model": spec.name, "tp": args.tp, "device": str(device), "dtype": "bf16", "rows": rows,
              "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    _write(args.json, result)


def run_model(args):
    import torch.distributed as dist

    import mindspeed_tp
    from mindspeed_tp.check.batch import make_batch
    from mindspeed_tp.check.driver import (build_stage, init_distributed, logprobs_from_logits, pipeline_forward,
                                           run_device, setup_parallel_state, teardown_parallel_state)
    from mindspeed_tp.check.builder import DTYPES
    from mindspeed_tp.models.layout import Layout
    from mindspeed_tp.models.spec import load_model_spec
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.devices import accelerator_available
    from mindspeed_tp.devices.cpu_shims import install_cpu_shims

    owns_group = not dist.is_initialized()  # a caller's process group (tests/workers/bench_smoke.py) stays
    init_distributed(600.0, args.device)
    if not accelerator_available():
        install_cpu_shims()
    device = run_device()
    spec, profile, layout = load_model_spec(args.model), load_profile(), Layout.parse(args.layout)
    if layout.required_world_size != dist.get_world_size():
        raise SystemExit(f"layout {layout.name} needs {layout.required_world_size} ranks, launched with "
                         f"{dist.get_world_size()}")
    dtype = DTYPES[args.dtype]
    batch = make_batch(spec.vocab_size, 0, args.batch_size, args.seq_length)
    scored = batch.scored.float().to(device)
    times = {"vanilla": {"forward_s": [], "step_s": []}, "consistent": {"forward_s": [], "step_s": []}}
    profiles = {}
    for mode in ("vanilla", "consistent") * args.rounds:  # interleaved against drift
        mindspeed_tp.disable() if mode == "vanilla" else mindspeed_tp.enable(profile)
        setup_parallel_state(layout, 0)
        model = build_stage(spec, layout, dtype, profile, 0)

        def forward():
            logits = pipeline_forward(model, layout, batch, spec.hidden_size, dtype)
            return None if logits is None else logprobs_from_logits(logits, batch, spec.vocab_size)

        def timed(fn):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            dist.barrier()
            return time.perf_counter() - t0

        def no_grad_forward():
            with torch.no_grad():
                forward()

        def step():
            model.zero_grad(set_to_none=True)
            lp = forward()
            loss = -(lp * scored).sum() / scored.sum()
            loss.backward()

        for i in range(args.repeats + 1):
            t = timed(no_grad_forward)
            if i:
                times[mode]["forward_s"].append(t)
        model.train()
        for i in range(args.repeats + 1):
            t = timed(step)
            if i:
                times[mode]["step_s"].append(t)
        if args.profile and mode not in profiles:  # one forward and one step per mode, after the timing
            profiles[mode] = {"forward": kernel_profile(no_grad_forward, device),
                              "step": kernel_profile(step, device)}
        model = None  # the closures above hold it: clear (freed as del would)
        teardown_parallel_state()
    mindspeed_tp.disable()
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in times.items()}
    ratios = {k: med["consistent"][k] / med["vanilla"][k] for k in ("forward_s", "step_s")}
    if dist.get_rank() == 0:
        print(f"model={spec.name} layout={layout.name} dtype={args.dtype} tokens={batch.tokens.numel()} "
              f"world={dist.get_world_size()} device={device}")
        for m in ("vanilla", "consistent"):
            print(f"{m:<11} forward {med[m]['forward_s'] * 1e3:9.1f} ms   step {med[m]['step_s'] * 1e3:9.1f} ms")
        print(f"ratio consistent/vanilla: forward {ratios['forward_s']:.2f}x   step {ratios['step_s']:.2f}x")
        for m, by_pass in profiles.items():
            for what, rows in by_pass.items():
                _print_profile(f"{m} {what}", rows)
        _write(args.json, {"model": spec.name, "layout": layout.name, "dtype": args.dtype,
                           "batch_size": args.batch_size, "seq_length": args.seq_length,
                           "world": dist.get_world_size(), "device": str(device),
                           "shared_gpu_host_staged": device.type == "cuda" and dist.get_backend() == "gloo",
                           "median": med, "ratios": ratios, "samples": times, "profile": profiles})
    if owns_group:
        dist.destroy_process_group()


def _write(path, data):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gemm", help="invariant GEMM vs cuBLAS TFLOP/s for the model's shapes")
    g.add_argument("--model", default="bench-dense-2048")
    g.add_argument("--tp", type=int, default=1, help="shapes of one rank at this TP")
    g.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="M values")
    g.add_argument("--warmup", type=int, default=3)
    g.add_argument("--iters", type=int, default=10)
    g.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    g.add_argument("--json")
    m = sub.add_parser("model", help="forward and step time, consistent vs vanilla (under torchrun)")
    m.add_argument("--model", default="bench-dense-2048")
    m.add_argument("--layout", default="tp1")
    m.add_argument("--dtype", default="bf16")
    m.add_argument("--batch-size", type=int, default=1)
    m.add_argument("--seq-length", type=int, default=4096)
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--rounds", type=int, default=1, help="vanilla/consistent builds per mode")
    m.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    m.add_argument("--profile", action="store_true",
                   help="also print each mode's top kernels by own time in one forward and one step (torch.profiler)")
    m.add_argument("--json")
    for parser in (g, m):
        add_verbose_flag(parser)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device (use --device cpu for a dry run)")
    run_gemm(args) if args.what == "gemm" else run_model(args)
    report_after_run(args.verbose, "gpu_bench")


if __name__ == "__main__":
    sys.exit(main())
