"""Where the consistent forward spends its time, module by module, next to vanilla.

    torchrun --standalone --nproc-per-node 2 benchmarks/module_shares.py --model bench-dense-1024 --layout tp2-sp

Forward pre/post hooks time every module of a few kinds (inclusive of what they call, collectives
included), summed over layers; the logprob (vocab-parallel cross entropy) is timed outside the
model. Prints per kind: vanilla ms, consistent ms, their ratio and the kind's share of the extra
time, so the note on what dominates the remaining cost is measured, not guessed. Rank 0 prints.
"""
import argparse
import statistics
import time
from collections import defaultdict

if __name__ == "__main__":  # run by torchrun: library warnings recorded from the first import of megatron on
    from mindspeed_tp.check import library_warnings

    library_warnings.record_this_run()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mindspeed_tp  # noqa: E402
from mindspeed_tp.devices.cpu_shims import install_cpu_shims  # noqa: E402
from mindspeed_tp.check.batch import make_batch  # noqa: E402
from mindspeed_tp.check.driver import (  # noqa: E402
    build_stage, init_distributed, logprobs_from_logits, pipeline_forward, setup_parallel_state, teardown_parallel_state,
)
from mindspeed_tp.check.builder import DTYPES  # noqa: E402
from mindspeed_tp.check.library_warnings import add_verbose_flag, report_after_run  # noqa: E402
from mindspeed_tp.models.layout import Layout  # noqa: E402
from mindspeed_tp.models.spec import load_model_spec  # noqa: E402
from mindspeed_tp.contract.profile import load_profile  # noqa: E402

# Module name suffix -> kind reported (the last matching suffix wins for nested names).
KINDS = ("embedding", "input_layernorm", "linear_qkv", "core_attention", "linear_proj", "self_attention",
         "pre_mlp_layernorm", "router", "linear_fc1", "linear_fc2", "mlp", "final_layernorm", "output_layer")


def _kind(name: str):
    last = name.split(".")[-1]
    if last in KINDS:
        return last
    return None


class ModuleTimer:
    def __init__(self, model):
        self.totals = defaultdict(float)
        self.handles = []
        for name, module in model.named_modules():
            kind = _kind(name)
            if kind is None or ".experts." in name:  # expert internals: reported under mlp
                continue
            self.handles.append(module.register_forward_pre_hook(self._start(module)))
            self.handles.append(module.register_forward_hook(self._stop(module, kind)))

    def _start(self, module):
        def hook(mod, args):
            mod._bench_t0 = time.perf_counter()
        return hook

    def _stop(self, module, kind):
        def hook(mod, args, out):
            self.totals[kind] += time.perf_counter() - mod._bench_t0
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def measure(spec, layout, dtype, profile, batch, mode, repeats):
    mindspeed_tp.disable() if mode == "vanilla" else mindspeed_tp.enable(profile)
    setup_parallel_state(layout, 0)
    model = build_stage(spec, layout, dtype, profile, 0)
    runs = []
    for i in range(repeats + 1):
        timer = ModuleTimer(model)
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = pipeline_forward(model, layout, batch, spec.hidden_size, dtype)
            t1 = time.perf_counter()
            logprobs_from_logits(logits, batch, spec.vocab_size)
        t2 = time.perf_counter()
        timer.close()
        if i:  # the first run warms up
            row = dict(timer.totals)
            row.update(logprob=t2 - t1, total=t2 - t0)
            runs.append(row)
    teardown_parallel_state()
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in set().union(*runs)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-dense-1024")
    p.add_argument("--layout", default="tp2-sp")
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=5)
    add_verbose_flag(p)
    args = p.parse_args(argv)
    owns_group = not dist.is_initialized()  # a caller's process group (tests/workers/bench_smoke.py) stays
    init_distributed()
    install_cpu_shims()
    spec, layout, profile = load_model_spec(args.model), Layout.parse(args.layout), load_profile()
    batch = make_batch(spec.vocab_size, 0, args.batch_size, args.seq_length)
    res = {}
    for mode in ("vanilla", "consistent"):
        res[mode] = measure(spec, layout, DTYPES[args.dtype], profile, batch, mode, args.repeats)
    if dist.get_rank() == 0:
        v, c = res["vanilla"], res["consistent"]
        extra = c["total"] - v["total"]
        print(f"module shares of the logprob forward: {args.model} {args.layout} seq={args.seq_length} "
              f"batch={args.batch_size} {args.dtype} world={dist.get_world_size()} (median of {args.repeats}; "
              f"inclusive times: self_attention contains qkv/attention/proj, mlp contains router/fc1/fc2)")
        print(f"{'module kind':<20}{'vanilla ms':>12}{'consistent ms':>15}{'ratio':>8}{'share of extra':>16}")
        for kind in KINDS + ("logprob", "total"):
            if kind not in v and kind not in c:
                continue
            a, b = v.get(kind, 0.0), c.get(kind, 0.0)
            share = f"{(b - a) / extra:.0%}" if extra > 0 and kind != "total" else "-"
            print(f"{kind:<20}{a * 1e3:>12.2f}{b * 1e3:>15.2f}{(b / a if a else float('nan')):>8.2f}{share:>16}")
    report_after_run(args.verbose, "module_shares")
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
