"""Cost of consistency: mindspeed-tp vs vanilla megatron-core, same layout, same run.

    torchrun --standalone --nproc-per-node 2 benchmarks/consistency_cost.py --json reports/cost.json

For each case (model, layout, sequence length) and mode it measures, interleaving the modes
against drift: the logprob forward time and the forward+backward step time (medians), the bytes
each rank sends through collectives per forward and per step (ring estimates, counted by wrapping
torch.distributed), the activation memory a step saves for backward, and the weight memory (parameters plus
the rollout-layout mode's cached re-laid weights). Modes: vanilla, the canonical-tree profile
(``consistent``) and the rollout-layout profile (``rollout``, default rollout-tp1). Forwards reuse the
re-laid weight cache (weights unchanged between scoring calls); each step starts with it invalidated,
as after an optimizer step, so step bytes include the re-layout. It prints the ratios
mode/vanilla and writes everything as JSON. Speed is reported here, never asserted in tests.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_counter  # noqa: E402

import mindspeed_tp  # noqa: E402
from mindspeed_tp.modes.rollout_layout import relayout  # noqa: E402
from mindspeed_tp.devices.cpu_shims import install_cpu_shims  # noqa: E402
from mindspeed_tp.check.batch import make_batch  # noqa: E402
from mindspeed_tp.check.harness import (  # noqa: E402
    _logprobs_from_logits, _pipeline_forward, _setup_parallel_state, _teardown_parallel_state, init_distributed,
)
from mindspeed_tp.check.report import write_json_atomic  # noqa: E402
from mindspeed_tp.check.builder import DTYPES, build_gpt_stage  # noqa: E402
from mindspeed_tp.models.layout import Layout  # noqa: E402
from mindspeed_tp.models.spec import load_model_spec  # noqa: E402
from mindspeed_tp.models.weights import load_seeded_weights  # noqa: E402
from mindspeed_tp.contract.profile import load_profile  # noqa: E402

MAIN_CASES = [("tiny-dense", "tp2-sp", 512), ("tiny-moe", "tp1-ep2", 512), ("tiny-moe", "tp2-sp-ep2", 512),
              ("bench-dense-1024", "tp2-sp", 512)]
SMOKE_CASES = [("tiny-dense", "tp2-sp", 32)]
SCALING_CASES = [("tiny-dense", "tp2-sp", 128), ("tiny-dense", "tp2-sp", 1024), ("bench-dense-1024", "tp2-sp", 256),
                 ("bench-dense-1024", "tp2-sp", 1024)]


class SavedActivations:
    """Bytes of the tensors autograd saves for backward during a forward (deduplicated by storage,
    parameters excluded): the activation memory a training step holds at its peak, the part of
    the peak the patches can change. Deterministic, unlike the process RSS (allocator caching)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages = {}

    def _pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.storages.clear()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


MODES = ("vanilla", "consistent", "rollout")


def measure(spec, layout, dtype, profiles, batch, mode, repeats, with_step):
    profile = profiles[mode]
    mindspeed_tp.disable() if mode == "vanilla" else mindspeed_tp.enable(profile)
    relayout.invalidate_relaid_weights()
    _setup_parallel_state(layout, 0)
    model = build_gpt_stage(spec, layout, dtype, profile)
    load_seeded_weights(model, spec, 0, layout)
    scored = batch.scored.float()
    out = {"forward_s": [], "step_s": []}

    def forward():
        logits = _pipeline_forward(model, layout, batch, spec.hidden_size, dtype)
        return _logprobs_from_logits(logits, batch, spec.vocab_size)

    for i in range(repeats + 1):
        dist.barrier()
        comm_counter.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            forward()
        dist.barrier()
        if i:
            out["forward_s"].append(time.perf_counter() - t0)
        out["forward_bytes"] = comm_counter.total()
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["weight_memory"] = (out["weight_bytes"] + relayout.relaid_cache_bytes()) / out["weight_bytes"]
    if with_step:
        model.train()
        for i in range(max(2, repeats // 2) + 1):
            model.zero_grad(set_to_none=True)
            relayout.invalidate_relaid_weights()  # as after an optimizer step
            dist.barrier()
            comm_counter.reset()
            t0 = time.perf_counter()
            with SavedActivations(model) as saved:
                loss = -(forward() * scored).sum() / scored.sum()
            loss.backward()
            dist.barrier()
            if i:
                out["step_s"].append(time.perf_counter() - t0)
            out["step_bytes"] = comm_counter.total()
            out["step_saved_bytes"] = saved.total
    del model
    relayout.invalidate_relaid_weights()
    return out


def run_case(model_name, layout_name, seq, dtype, profiles, repeats, with_step):
    spec, layout = load_model_spec(model_name), Layout.parse(layout_name)
    batch = make_batch(spec.vocab_size, 0, 2, seq)
    runs = {mode: [] for mode in MODES}
    for mode in MODES + MODES:
        runs[mode].append(measure(spec, layout, dtype, profiles, batch, mode, repeats, with_step))
    row = {"model": model_name, "layout": layout_name, "seq_length": seq, "tokens": batch.tokens.numel()}
    for mode, rs in runs.items():
        row[mode] = {
            "forward_s": statistics.median(sum((r["forward_s"] for r in rs), [])),
            "forward_bytes": rs[-1]["forward_bytes"],
            "weight_memory": rs[-1]["weight_memory"],
        }
        if with_step:
            row[mode].update(step_s=statistics.median(sum((r["step_s"] for r in rs), [])),
                             step_bytes=rs[-1]["step_bytes"], step_saved_bytes=rs[-1]["step_saved_bytes"])
    v = row["vanilla"]

    def ratios(mode):
        return {k: row[mode][k] / v[k] if v.get(k) else float("nan") for k in v}

    row["ratios"] = ratios("consistent")  # canonical tree / vanilla
    row["rollout_ratios"] = ratios("rollout")
    _teardown_parallel_state()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="reports/consistency_cost.json")
    p.add_argument("--quick", action="store_true", help="tiny models only (smoke run)")
    p.add_argument("--smoke", action="store_true", help="one tiny case, short sequences (seconds; the tests run it)")
    p.add_argument("--rollout-profile", default="rollout-tp1", help="profile of the rollout-layout mode")
    args = p.parse_args(argv)
    owns_group = not dist.is_initialized()  # a caller's process group (tests/workers/bench_smoke.py) stays
    init_distributed()
    install_cpu_shims()
    comm_counter.counter.apply()
    dtype = DTYPES[args.dtype]
    profiles = {"vanilla": load_profile(), "consistent": load_profile(), "rollout": load_profile(args.rollout_profile)}
    main_cases = SMOKE_CASES if args.smoke else MAIN_CASES[:3] if args.quick else MAIN_CASES
    scaling_cases = [] if args.quick or args.smoke else SCALING_CASES
    repeats = 1 if args.smoke else args.repeats
    rows = [run_case(m, l, s, dtype, profiles, repeats, True) for m, l, s in main_cases]
    scaling = [run_case(m, l, s, dtype, profiles, repeats, False) for m, l, s in scaling_cases]
    if dist.get_rank() == 0:
        print(f"mode/vanilla ratios (median of repeats), dtype={args.dtype}, world={dist.get_world_size()}, "
              f"rollout mode: {args.rollout_profile}")
        print(f"{'model':<18}{'layout':<12}{'seq':>6}{'mode':>12}{'fwd':>8}{'step':>8}{'bytes/fwd':>11}"
              f"{'bytes/step':>11}{'act mem':>10}{'weights':>9}{'fwd ms (van)':>14}")
        for r in rows:
            for mode, key in (("tree", "ratios"), ("rollout", "rollout_ratios")):
                q = r[key]
                print(f"{r['model']:<18}{r['layout']:<12}{r['seq_length']:>6}{mode:>12}{q['forward_s']:>8.2f}"
                      f"{q['step_s']:>8.2f}{q['forward_bytes']:>11.2f}{q['step_bytes']:>11.2f}{q['step_saved_bytes']:>10.2f}"
                      f"{q['weight_memory']:>9.2f}{r['vanilla']['forward_s'] * 1e3:>14.1f}")
        if scaling:
            print("\nscaling of the forward ratio with model size and sequence length")
            for r in scaling:
                print(f"{r['model']:<18}{r['layout']:<12}{r['seq_length']:>6}{r['ratios']['forward_s']:>8.2f} tree"
                      f"{r['rollout_ratios']['forward_s']:>8.2f} rollout{r['vanilla']['forward_s'] * 1e3:>10.1f} ms vanilla")
        write_json_atomic(args.json, {"dtype": args.dtype, "world": dist.get_world_size(),
                                      "rollout_profile": args.rollout_profile, "cases": rows,
                                      "scaling": scaling})
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
