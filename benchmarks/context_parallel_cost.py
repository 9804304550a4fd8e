"""Cost of context parallelism (CP) in the consistent attention: per-rank activation memory and the
key/value exchange, CP = 2 against CP = 1, on one long sequence.

    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel_cost.py --seq 8192 --json r.json

For each layout (tp1: both ranks run the whole sequence as data-parallel replicas; tp1-cp2: each
rank its two chunks) it measures on rank 0: the activation memory a forward+backward step saves
for backward (autograd's saved tensors, parameters excluded, ``consistency_cost.SavedActivations``:
with CP this includes the gathered keys/values each layer's attention keeps for its backward), the
bytes the rank sends through collectives per forward and per step (``comm_counter``: at tp1-cp2
these are the K/V all-gathers and, in backward, their gradients' all-reduce), and the forward and
step times. It prints ratios to CP = 1; nothing is asserted.

The exchange is an all-gather (``kernels/context_parallel.py`` says why: the consistent kernel
visits key blocks in absolute-position order from block 0, which a ring would deliver out of
order); its bytes per layer are (CP-1)/CP of the whole sequence's K and V.
"""
import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_counter  # noqa: E402
from consistency_cost import SavedActivations  # noqa: E402

import mindspeed_tp  # noqa: E402
from mindspeed_tp.check.batch import ScoringBatch  # noqa: E402
from mindspeed_tp.check.builder import DTYPES, build_gpt_stage  # noqa: E402
from mindspeed_tp.check.context_parallel import cp_state, local_columns  # noqa: E402
from mindspeed_tp.check.harness import (  # noqa: E402
    _logprobs_from_logits, _pipeline_forward, _setup_parallel_state, init_distributed,
)
from mindspeed_tp.check.report import write_json_atomic  # noqa: E402
from mindspeed_tp.contract.profile import load_profile  # noqa: E402
from mindspeed_tp.devices.cpu_shims import install_cpu_shims  # noqa: E402
from mindspeed_tp.models.layout import Layout  # noqa: E402
from mindspeed_tp.models.spec import load_model_spec  # noqa: E402
from mindspeed_tp.models.weights import load_seeded_weights  # noqa: E402


def measure(spec, layout, dtype, profile, batch):
    mindspeed_tp.enable(profile)
    _setup_parallel_state(layout, 0)
    model = build_gpt_stage(spec, layout, dtype, profile)
    load_seeded_weights(model, spec, 0, layout)
    _, size, rank = cp_state()
    s = batch.tokens.shape[1]
    columns = local_columns(s, size, rank) if size > 1 else None
    targets = batch.targets if columns is None else batch.targets[:, columns]
    scored = (batch.scored if columns is None else batch.scored[:, columns]).float()

    def forward():
        logits = _pipeline_forward(model, layout, batch, spec.hidden_size, dtype, None, columns)
        return _logprobs_from_logits(logits, batch, spec.vocab_size, targets=targets)

    out = {"layout": layout.name, "tokens_per_rank": s // size}
    dist.barrier()
    comm_counter.reset()
    t0 = time.perf_counter()
    with torch.no_grad():
        forward()
    out["forward_s"] = time.perf_counter() - t0
    out["forward_bytes"] = comm_counter.total()
    model.train()
    dist.barrier()
    comm_counter.reset()
    t0 = time.perf_counter()
    with SavedActivations(model) as saved:
        loss = -(forward() * scored).sum()
    loss.backward()
    out["step_s"] = time.perf_counter() - t0
    out["step_bytes"] = comm_counter.total()
    out["saved_bytes"] = saved.total
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-dense")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--json")
    args = p.parse_args(argv)
    owns_group = not dist.is_initialized()  # a caller's process group (tests/workers/bench_smoke.py) stays
    init_distributed()
    install_cpu_shims()
    comm_counter.counter.apply()
    spec = load_model_spec(args.model)
    spec = dataclasses.replace(spec, max_position_embeddings=max(spec.max_position_embeddings, args.seq))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (1, args.seq), generator=gen)
    batch = ScoringBatch(tokens=tokens, lengths=[args.seq])
    dtype, profile = DTYPES[args.dtype], load_profile("default")
    rows = [measure(spec, layout, dtype, profile, batch) for layout in (Layout(), Layout(cp=2))]
    base = rows[0]
    for r in rows:
        r["saved_ratio"] = r["saved_bytes"] / base["saved_bytes"]
    if dist.get_rank() == 0:
        print(f"model={spec.name} seq={args.seq} dtype={args.dtype} (rank 0)")
        print(f"{'layout':<10}{'tokens/rank':>12}{'act MiB':>10}{'vs cp1':>8}{'KV MiB/fwd':>12}{'MiB/step':>10}"
              f"{'fwd s':>8}{'step s':>8}")
        for r in rows:
            print(f"{r['layout']:<10}{r['tokens_per_rank']:>12}{r['saved_bytes'] / 2**20:>10.1f}"
                  f"{r['saved_ratio']:>8.2f}{r['forward_bytes'] / 2**20:>12.1f}{r['step_bytes'] / 2**20:>10.1f}"
                  f"{r['forward_s']:>8.2f}{r['step_s']:>8.2f}")
        if args.json:
            write_json_atomic(args.json, {"model": spec.name, "seq": args.seq, "dtype": args.dtype, "rows": rows})
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
