"""Run a GPTModel forward in one layout and return per-token logprobs on every rank.

Layouts are run one after another in the same torchrun world (Megatron's parallel state is
rebuilt for each), so the reference TP=PP=1 run and the distributed runs share processes,
thread settings and weights generator.
"""
from __future__ import annotations

import datetime
import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import state
from ..contract.profile import Profile
from ..devices.npu_runtime import import_required
from ..errors import ConfigError
from ..kernels import mask_padded_vocab
from ..patches import moe as moe_patch
from ..switch import disable, enable
from . import bisect, hooks
from .batch import PackedBatch, ScoringBatch, pack_batch
from .builder import build_gpt_stage
from .context_parallel import cp_state, gather_columns, global_rows, local_columns, place_rows
from ..models.layout import Layout
from ..models.spec import ModelSpec
from ..models.weights import SeededWeights, load_weights

# --timeout: the world's process group and every group Megatron creates fail a collective (or a
# pipeline send/recv) that waits longer than this, so a dead or hung peer never hangs the others.
_timeout_s = 600.0


# Where models run: the CPU (gloo), this rank's NPU (--device npu) or GPU (--device cuda).
_device = torch.device("cpu")


def init_distributed(timeout_s: float = 600.0, device: str = "cpu") -> None:
    """One process group for the run. On ``npu`` it maps CPU tensors to gloo (the checker's own
    bookkeeping) and NPU tensors to HCCL (the model's collectives); on ``cuda`` CUDA tensors to
    NCCL, or, when ranks share a GPU, everything to gloo with CUDA collectives staged through host
    memory (check/host_staging.py)."""
    global _device, _timeout_s
    _timeout_s = float(timeout_s)
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python -m`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    backend = "gloo"
    if device == "npu":

        who, alternative = "--device npu", "; or run the checker with --device cpu"
        import_required("torch_npu", "torch_npu", who, alternative)
        # megatron-core calls torch.cuda.*: torch_npu maps them to the NPU (as MindSpeed's adaptor does).
        import_required("torch_npu.contrib.transfer_to_npu", "torch_npu", who, alternative)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.npu.set_device(local)
        _device = torch.device("npu", local)
        backend = "cpu:gloo,npu:hccl"
    elif device == "cuda":
        _device, backend = _cuda_rank_device()
    elif device != "cpu":
        raise ConfigError(f"--device {device!r}: use cpu, cuda or npu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


CUDA_MISSING = ("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False); run the "
                "checker with --device cpu")


def _cuda_rank_device() -> Tuple[torch.device, str]:
    """This rank's GPU (local rank modulo the GPUs present) and the process group's backend."""
    if not torch.cuda.is_available():
        raise ConfigError(CUDA_MISSING)
    from .host_staging import install_host_staging, ranks_share_a_device

    count = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.cuda.set_device(local % count)
    if ranks_share_a_device(local_world, count):
        install_host_staging("cuda")
        return torch.device("cuda", local % count), "gloo"
    return torch.device("cuda", local), "cpu:gloo,cuda:nccl"


def run_device() -> torch.device:
    return _device


_current_layout: Optional[Layout] = None


def _megatron_groups(parallel_state) -> list:
    """Every process group Megatron's parallel state holds (its module globals)."""
    found, seen = [], set()

    def visit(value):
        if isinstance(value, dist.ProcessGroup):
            if id(value) not in seen and value is not dist.GroupMember.WORLD:
                seen.add(id(value))
                found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    for value in list(vars(parallel_state).values()):
        visit(value)
    return found


def _teardown_parallel_state() -> None:
    """destroy_model_parallel forgets Megatron's groups but c10d keeps them (each with its own
    threads and sockets); release them so many layouts can run in one process."""
    global _current_layout
    from megatron.core import parallel_state

    groups = _megatron_groups(parallel_state)
    parallel_state.destroy_model_parallel()
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # already released, or not a member
            pass
    _current_layout = None


def _setup_parallel_state(layout: Layout, seed: int, training: bool = False) -> None:
    """Megatron's parallel state for ``layout``. training: the train-check's world (exactly
    tp*cp*pp*dp processes, virtual pipeline stages, and the gloo groups megatron's optimizers use)."""
    global _current_layout
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from .. import compat

    world = dist.get_world_size()
    if training and world != layout.world_size:
        raise ConfigError(f"training layout {layout.name} needs exactly tp*cp*pp*dp={layout.world_size} processes; "
                          f"launched with {world} (mindspeed-tp train-check launches one world per size)")
    if world % layout.required_world_size:
        raise ConfigError(
            f"layout {layout.name} needs a world size divisible by {layout.required_world_size} (tp*pp and "
            f"etp*ep*pp); launched with {world} processes (change --nproc or the layout)"
        )
    key = (layout, training)
    if _current_layout != key or not parallel_state.model_parallel_is_initialized():
        if parallel_state.model_parallel_is_initialized():
            _teardown_parallel_state()
        kwargs = {}
        if compat.supports_gloo_group_flag():
            # The default backend is gloo already; megatron's optimizers also ask for its gloo groups.
            kwargs["create_gloo_process_groups"] = training
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            context_parallel_size=layout.cp,
            distributed_timeout_minutes=_timeout_s / 60.0,
            **kwargs,
        )
        _current_layout = key
    model_parallel_cuda_manual_seed(seed)


def _engine_scoring(profile: Profile, vanilla: bool, batch: ScoringBatch, spec: ModelSpec):
    """A real-engine profile scores prompts as the engine's prefill and the rest as its decode steps."""
    from contextlib import nullcontext

    from ..numerics.vllm import forward as vllm_forward

    if vanilla or not vllm_forward.is_vllm(profile):
        return nullcontext()
    from ..numerics.vllm.scoring import engine_scoring

    b, s = batch.tokens.shape
    return engine_scoring(batch.prompt_lens or [s] * b, spec.vocab_size, batch.prefill_chunks)


def _stage_dtype(profile: Profile, vanilla: bool, dtype):
    """What pipeline stages send: the model dtype, or fp32 under a real-engine profile (the residual
    stream is the engine's unrounded fused-add sum)."""
    from ..numerics.vllm import forward as vllm_forward

    return torch.float32 if not vanilla and vllm_forward.is_vllm(profile) else dtype


def _pipeline_forward(model, layout: Layout, batch: ScoringBatch, hidden: int, dtype,
                      packed: Optional[PackedBatch] = None, columns: Optional[torch.Tensor] = None):
    """Forward through this rank's stage; activations move between stages by send/recv. With
    ``packed``: one row of packed (thd) sequences, boundaries in PackedSeqParams, no mask.
    ``columns``: under CP, the sequence (or packed-row) columns this rank holds (its 2 chunks); the
    mask keeps their query rows over every key, the boundaries stay the whole row's."""
    from megatron.core import parallel_state

    extra = {}
    if packed is not None:
        tokens, positions, mask = packed.tokens, packed.positions.to(_device), None
        extra["packed_seq_params"] = packed.packed_seq_params(_device)
    else:
        tokens = batch.tokens
        b, s = tokens.shape
        positions = torch.arange(s, device=_device).unsqueeze(0).expand(b, s)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=_device), diagonal=1).view(1, 1, s, s)
    if columns is not None:
        tokens, positions = tokens[:, columns], positions[:, columns.to(_device)]
        mask = None if mask is None else mask[:, :, columns.to(_device)]
    b, s = tokens.shape
    if not parallel_state.is_pipeline_first_stage():
        rows = s // layout.tp if layout.sp else s
        received = torch.empty(rows, b, hidden, dtype=dtype, device=_device)
        dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
    out = model(tokens.to(_device), positions, mask, **extra)
    if not parallel_state.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return out


def _logprobs_from_logits(
    logits: torch.Tensor, batch: ScoringBatch, vocab_size: int, temperature: float = 1.0,
    targets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token logprobs through Megatron's vocab_parallel_cross_entropy (patched or vanilla).

    The patch excludes padded vocab columns itself (it is told the true size, as a model config
    tells it); vanilla megatron cannot, so for vanilla they are set to -inf first (exact). targets: instead of
    ``batch.targets`` (packed sequences).
    """
    from megatron.core import parallel_state, tensor_parallel

    if not state.enabled():
        start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
        logits = mask_padded_vocab(logits, vocab_size, start)
    if temperature != 1.0:  # as rollout engines do: logprob of softmax(logits / T), in fp32
        logits = logits.float() / temperature
    targets = batch.targets if targets is None else targets
    with state.model_vocab_size(vocab_size):
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, targets.to(logits.device))


class _RoutingCapture:
    """Collects each MoE layer's chosen experts per local token: from the patched MoE forward
    (consistent mode) or from the TopKRouter's output (vanilla)."""

    def __init__(self, model, vanilla: bool, num_experts: int):
        self.maps = {}
        self.handles = []
        self.num_experts = num_experts
        if vanilla:
            from megatron.core.transformer.moe.router import TopKRouter

            for module in model.modules():
                if isinstance(module, TopKRouter):
                    self.handles.append(module.register_forward_hook(self._hook))
        else:
            moe_patch.add_routing_observer(self._observe)

    def _hook(self, module, args, output):
        self.maps[module.layer_number] = output[1].reshape(-1, output[1].shape[-1]).bool()

    def _observe(self, layer, idx):
        chosen = torch.zeros(idx.shape[0], self.num_experts, dtype=torch.bool, device=idx.device)
        chosen.scatter_(1, idx, True)
        self.maps[getattr(layer, "layer_number", id(layer))] = chosen

    def close(self):
        for h in self.handles:
            h.remove()
        moe_patch.remove_routing_observer(self._observe)


def _full_routing(maps, layout: Layout, spec: ModelSpec, tokens: int, rows=None) -> torch.Tensor:
    """(num_layers, s*b, E) uint8 on every rank: layer l's expert set per token (zeros if dense).
    rows: under CP, each local token's row in the whole batch (the other CP ranks fill the rest)."""
    from megatron.core import parallel_state

    full = torch.zeros(spec.num_layers, tokens, spec.num_experts, dtype=torch.uint8)
    group = parallel_state.get_tensor_model_parallel_group()
    for layer_number, chosen in sorted(maps.items()):
        if layout.sp and layout.tp > 1:
            parts = [torch.empty_like(chosen, dtype=torch.uint8) for _ in range(layout.tp)]
            dist.all_gather(parts, chosen.to(torch.uint8), group=group)
            chosen = torch.cat(parts)
        full[layer_number - 1] = place_rows(chosen.to(torch.uint8).cpu(), rows, tokens)
    dist.all_reduce(full, op=dist.ReduceOp.MAX)  # replicas hold equal maps; absent layers are 0
    return full


def layout_logprobs(
    spec: ModelSpec,
    layout: Layout,
    dtype: torch.dtype,
    profile: Profile,
    seed: int,
    batch: ScoringBatch,
    vanilla: bool,
    dispatcher: str = "alltoall",
    temperature: float = 1.0,
    weights=None,
    diagnostics: Optional[dict] = None,
    packed: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(b, s) fp32 logprobs of ``batch`` under ``layout``, identical on every rank afterwards, and
    for MoE models the routing decisions (num_layers, s*b, E) (None for dense models).

    weights: where the parameters come from (default: the seeded weights of ``seed``).
    diagnostics (optional dict) receives ``logits_nonfinite`` (NaN/inf count in the real-vocab
    logits) and ``logits_first_nonfinite`` ([batch, position] or None); with
    ``diagnostics["record_modules"]`` true, ``modules``: every module's full input/output on rank 0
    (see bisect.py). packed: score the sequences packed (thd, see ``batch.pack_batch``); the result
    is unpacked to the padded (b, s) layout."""
    from megatron.core import parallel_state


    hooks.at_point("forward", dist.get_rank())
    record = bool(diagnostics and diagnostics.get("record_modules"))

    if vanilla:
        disable()
    else:
        enable(profile)
    _setup_parallel_state(layout, seed)
    # A dense model needs one data-parallel replica; MoE experts span replicas, so all compute.
    computes = spec.is_moe or parallel_state.get_data_parallel_rank() == 0
    result = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    maps, recorder = {}, None
    b, s = batch.tokens.shape
    nonfinite = torch.tensor([0, b * s])  # count, first flat index b*s+pos (b*s: none)
    # Under CP each packed sequence is padded to a multiple of 2*CP*TP, as Megatron's thd CP batch.
    packing = pack_batch(batch, layout.tp * (2 * layout.cp if layout.cp > 1 else 1)) if packed else None
    cp_group, cp_size, cp_rank = cp_state()
    cu = packing.cu_seqlens if packed else None
    length = packing.tokens.shape[1] if packed else s
    columns = local_columns(length, cp_size, cp_rank, cu) if cp_size > 1 else None
    if computes:
        model = build_gpt_stage(spec, layout, dtype, profile, dispatcher)
        load_weights(model, spec, layout, weights or SeededWeights(spec, seed))
        model.to(_device)
        handles = hooks.before_forward(model, layout, parallel_state.get_tensor_model_parallel_rank())
        capture = _RoutingCapture(model, vanilla, spec.num_experts) if spec.is_moe else None
        recorder = bisect.ModuleRecorder(model, spec.num_layers) if record else None
        try:
            with torch.no_grad(), _engine_scoring(profile, vanilla, batch, spec):
                out = _pipeline_forward(model, layout, batch, spec.hidden_size, _stage_dtype(profile, vanilla, dtype),
                                        packing, columns)
        finally:
            for h in handles:
                h.remove()
            if recorder is not None:
                recorder.close()
            if capture is not None:
                capture.close()
                maps = capture.maps
        if out is not None:
            out = hooks.on_logits(out, layout, parallel_state.get_tensor_model_parallel_rank())
            if parallel_state.get_data_parallel_rank() == 0:
                nonfinite = _count_nonfinite_logits(out, spec.vocab_size, columns, length)
                if packed:  # first packed column -> flat index in the padded (b, s) layout
                    nonfinite[1] = packing.padded_index(int(nonfinite[1]), s, none=b * s)
            targets = packing.targets if packed else (batch.targets if columns is not None else None)
            if columns is not None:
                targets = targets[:, columns]
            with _engine_scoring(profile, vanilla, batch, spec):
                result = _logprobs_from_logits(out, batch, spec.vocab_size, temperature, targets).float().cpu()
            if columns is not None:  # every CP rank's tokens, back in sequence order
                result = gather_columns(result, length, cp_group, cp_size, cu)
            if packed:
                result = packing.unpack(result, batch.tokens.shape)
    # The owner of the answer: last pipeline stage, TP rank 0, DP rank 0.
    is_src = (
        parallel_state.get_data_parallel_rank() == 0
        and parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    flags = torch.tensor([dist.get_rank() if is_src else -1])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    dist.broadcast(result, src=int(flags.item()))
    routing = None
    if spec.is_moe:
        rows = None if columns is None else (columns if packed else global_rows(columns, b))
        routing = _full_routing(maps, layout, spec, packing.tokens.numel() if packed else batch.tokens.numel(), rows)
        if packed:
            routing = packing.unpack_tokens(routing, b, s)
    if diagnostics is not None:
        count, first = nonfinite[:1].clone(), nonfinite[1:].clone()
        dist.all_reduce(count)  # only the last stage's DP-rank-0 TP ranks contribute, each its vocab slice
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        diagnostics["logits_nonfinite"] = int(count)
        diagnostics["logits_first_nonfinite"] = None if int(first) == b * s else [int(first) // s, int(first) % s]
        if record:
            moe_layers = list(range(spec.first_k_dense, spec.num_layers)) if spec.is_moe else []
            diagnostics["modules"] = bisect.collect(recorder, layout, spec.num_layers, batch, result, routing,
                                                    moe_layers)
    return result, routing


def _count_nonfinite_logits(logits: torch.Tensor, vocab_size: int, columns=None, length=None) -> torch.Tensor:
    """[count, first b*s+pos] of NaN/inf in this rank's real-vocab logit columns (GPTModel returns
    [b, s, v/tp]). Padded vocab columns are excluded: they become -inf on purpose. Under CP
    (``columns`` of a row of ``length``) the position is the token's in the whole sequence."""
    from megatron.core import parallel_state

    b, s, width = logits.shape
    start = parallel_state.get_tensor_model_parallel_rank() * width
    real = logits[..., : max(0, min(width, vocab_size - start))]
    bad = ~torch.isfinite(real)
    per_token = bad.any(dim=-1).reshape(-1)  # (b*s) in batch-major order
    hits = torch.nonzero(per_token)
    if columns is None:
        return torch.tensor([int(bad.sum()), int(hits[0]) if len(hits) else b * s])
    firsts = [int(h) // s * length + int(columns[int(h) % s]) for h in hits[:, 0]]
    return torch.tensor([int(bad.sum()), min(firsts) if firsts else b * length])
