"""The one Megatron driver of the checkers (``check``, ``train-check``, ``rl-check``) and the benchmarks.

- The world: ``init_distributed`` (one process group; the device models run on, ``run_device``) and
  Megatron's parallel state per layout (``setup_parallel_state`` / ``teardown_parallel_state``).
- The model: ``build_stage`` (one rank's GPTModel, for scoring) or ``build_ddp_chunks`` (its
  chunks in megatron's DDP, for training), ``make_optimizer``, ``wire_config``, ``release_models``.
- Forward only: ``pipeline_forward`` through this rank's stage (send/recv between stages) and
  ``logprobs_from_logits`` (megatron's ``vocab_parallel_cross_entropy``), under a real-engine
  profile inside ``engine_scoring``.
- Micro-batches through megatron's schedules (``get_forward_backward_func``): ``micro_batch_rows``
  or ``token_budget_rows`` deal the rows, a ``Pass`` is the data iterator, forward step and loss
  function of one schedule call, ``gather_rows`` moves what it recorded to every rank.
"""
from __future__ import annotations

import datetime
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import compat, state
from ..contract.profile import Profile
from ..contract.sampling import Sampling
from ..devices.npu_runtime import import_required
from ..errors import ConfigError
from ..kernels import mask_padded_vocab
from ..kernels.collectives import gather_along_rank
from ..kernels.sampling import divide_by_temperature, mask_dropped_vocab, reference_mask
from ..models.layout import Layout
from ..models.spec import ModelSpec
from ..models.weights import SeededWeights, load_weights
from .batch import PackedBatch, ScoringBatch
from .builder import build_gpt_chunks, build_gpt_stage
from .context_parallel import cp_state, gather_columns, local_columns

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


def start_world(ns) -> None:
    """A checker worker's start: its plugins (``hooks``), the user's TransformerConfig fields, the
    process group on ``--device`` with ``--timeout``, and the shims its megatron-core needs here."""
    from ..devices.cpu_shims import install_checker_shims
    from . import hooks
    from .builder import set_user_fields

    hooks.load_plugins()
    set_user_fields(ns.transformer_fields)
    init_distributed(float(ns.timeout), ns.device)
    install_checker_shims()


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
    """Where this rank's models run (set by ``init_distributed``)."""
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


def teardown_parallel_state() -> None:
    """destroy_model_parallel forgets Megatron's groups but c10d keeps them (each with its own
    threads and sockets); release them so many layouts can run in one process."""
    global _current_layout
    from megatron.core import parallel_state

    groups = _megatron_groups(parallel_state)
    parallel_state.destroy_model_parallel()
    compat.forget_stale_embedding_ranks(parallel_state)
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # already released, or not a member
            pass
    _current_layout = None


def setup_parallel_state(layout: Layout, seed: int, training: bool = False) -> None:
    """Megatron's parallel state for ``layout``. training: the train-check's world (exactly
    tp*cp*pp*dp processes, virtual pipeline stages, and the gloo groups megatron's optimizers use)."""
    global _current_layout
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

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
            teardown_parallel_state()
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


def engine_scoring(profile: Profile, vanilla: bool, batch: ScoringBatch, spec: ModelSpec):
    """A real-engine profile scores prompts as the engine's prefill and the rest as its decode steps."""
    from contextlib import nullcontext

    from ..numerics.vllm import forward as vllm_forward

    if vanilla or not vllm_forward.is_vllm(profile):
        return nullcontext()
    from ..numerics.vllm.scoring import engine_scoring

    b, s = batch.tokens.shape
    return engine_scoring(batch.prompt_lens or [s] * b, spec.vocab_size, batch.prefill_chunks)


def stage_dtype(profile: Profile, vanilla: bool, dtype):
    """What pipeline stages send: the model dtype, or fp32 under a real-engine profile (the residual
    stream is the engine's unrounded fused-add sum)."""
    from ..numerics.vllm import forward as vllm_forward

    return torch.float32 if not vanilla and vllm_forward.is_vllm(profile) else dtype


def pipeline_forward(model, layout: Layout, batch: ScoringBatch, hidden: int, dtype,
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


def logprobs_from_logits(
    logits: torch.Tensor, batch: ScoringBatch, vocab_size: int, sampling: Optional[Sampling] = None,
    targets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token logprobs through Megatron's vocab_parallel_cross_entropy (patched or vanilla), of
    ``sampling``'s semantics (default: raw): fp32 logits divided by its scoring temperature as the
    engine divides them, and under processed semantics renormalised over what its top-k / top-p keep.

    The patch excludes padded vocab columns itself (it is told the true size, as a model config
    tells it); vanilla megatron cannot, so for vanilla they are set to -inf first (exact), and its
    top-k / top-p mask is the reference engine's, applied here. targets: instead of
    ``batch.targets`` (packed sequences).
    """
    from megatron.core import parallel_state, tensor_parallel

    sampling = sampling or Sampling()
    if not state.enabled():
        start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
        logits = mask_padded_vocab(logits, vocab_size, start)
    if sampling.scoring_temperature != 1.0:  # the engine's fp32 division (kernels.sampling)
        logits = divide_by_temperature(logits, sampling.scoring_temperature)
    if sampling.masks and not state.enabled():
        logits = mask_dropped_vocab(logits.float(), parallel_state.get_tensor_model_parallel_group(), vocab_size,
                                    reference_mask(sampling))
    targets = batch.targets if targets is None else targets
    with state.model_vocab_size(vocab_size), state.scoring_sampling(sampling if state.enabled() else None):
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, targets.to(logits.device))


def build_stage(spec: ModelSpec, layout: Layout, dtype, profile: Profile, seed: int, dispatcher: str = "alltoall",
                weights=None):
    """This rank's GPTModel stage for scoring (eval mode) with ``weights`` (default: the seeded
    weights of ``seed``), on the run's device."""
    model = build_gpt_stage(spec, layout, dtype, profile, dispatcher)
    load_weights(model, spec, layout, weights or SeededWeights(spec, seed))
    return model.to(_device)


RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def build_ddp_chunks(spec, layout, dtype, profile, settings):
    """The model chunks in megatron's DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    # perform_initialization: what a training run does; it also tags the TP-sharded weights
    # (tensor_model_parallel, partition_dim), which the gradient norm and clipping read. The seeded
    # weights overwrite the values.
    overrides = dict(RECOMPUTE[settings.recompute], calculate_per_token_loss=True, perform_initialization=True)
    if layout.vpp > 1:
        # Megatron-LM's settings for the interleaved schedule. With batched p2p and pp=2 the previous
        # and next stage are one rank, and a forward activation and a backward gradient of the same
        # shape travel the same way in one batch: the receiver can match them crosswise.
        overrides.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    chunks = build_gpt_chunks(spec, layout, dtype, profile, settings.dispatcher, **overrides)
    for chunk in chunks:
        load_weights(chunk, spec, layout, SeededWeights(spec, settings.seed))
        chunk.to(run_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=settings.overlap,
        overlap_param_gather=settings.overlap and settings.distributed_optimizer,
        use_distributed_optimizer=settings.distributed_optimizer,
        bucket_size=_BUCKET_SIZE,
    )
    # As Megatron-LM's get_model: bucketing only for the first chunk (the others overlap with it).
    wrapped = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    return chunks, wrapped, ddp_config


# Small buckets, so a tiny model still has several (the bucketed, overlapped reduction is exercised).
_BUCKET_SIZE = 40000


def make_optimizer(wrapped, dtype, settings, kind: str = "adam"):
    """Adam (or ``kind="sgd"``: no momentum, so no state -- megatron's distributed optimizer is
    Adam-only, so settings.distributed_optimizer must be off), clip 1.0."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer=kind, lr=settings.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        sgd_momentum=0.0, clip_grad=1.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=settings.distributed_optimizer,
    )
    return get_megatron_optimizer(config, wrapped)


def release_models(wrapped, config) -> None:
    """Lets the garbage collector free DDP-wrapped models and their optimizer once unreferenced.
    The distributed optimizer's shards are views of the parameters, whose autograd nodes (held in
    C++, out of the collector's sight) reach DDP's gradient hooks and so the DDP; the model config
    refers to the optimizer (``wire_config``): a cycle never freed -- a model, its buffers and its
    optimizer state per layout or mode a process runs. Unwiring the config and DDP's kept gradient
    accumulators breaks it. So does a tensor of the last step's graph kept on the model: megatron's
    MoE token dispatchers keep the routing probabilities (``self.probs``), whose graph reaches the
    router's weight and so DDP's hooks again."""
    for name in WIRED_CONFIG_FIELDS:
        setattr(config, name, None)
    for m in wrapped:
        getattr(m, "grad_accs", []).clear()
        for module in m.modules():
            _drop_graph_tensors(module)
            for held in list(vars(module).values()):  # helpers kept as plain attributes (a token dispatcher)
                if not isinstance(held, (torch.nn.Module, torch.Tensor)) and hasattr(held, "__dict__"):
                    _drop_graph_tensors(held)


def _drop_graph_tensors(obj) -> None:
    """Unset the attributes of ``obj`` that hold a tensor of an autograd graph (not a leaf)."""
    for name, value in list(vars(obj).items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            setattr(obj, name, None)


WIRED_CONFIG_FIELDS = ("grad_scale_func", "finalize_model_grads_func", "no_sync_func", "grad_sync_func",
                       "param_sync_func")


def wire_config(config, wrapped, ddp_config, optimizer) -> None:
    """The hooks a Megatron training script sets on the model config (Megatron-LM's training.py)."""
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(fns):
        return fns[0] if len(fns) == 1 else fns

    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = one_or_list([m.no_sync for m in wrapped])
        config.grad_sync_func = one_or_list([m.start_grad_sync for m in wrapped])
    if ddp_config.overlap_param_gather:
        config.param_sync_func = one_or_list([m.start_param_sync for m in wrapped])


def micro_batch_rows(num: int, micro_batch_size: int, dp: int, dp_rank: int) -> List[torch.Tensor]:
    """Global rows of each micro-batch of this DP rank, as Megatron's pretraining sampler deals them:
    chunk i of mbs*dp sequences, rank d takes rows [d*mbs, (d+1)*mbs) of it."""
    per_chunk = micro_batch_size * dp
    return [torch.arange(i * per_chunk + dp_rank * micro_batch_size, i * per_chunk + (dp_rank + 1) * micro_batch_size)
            for i in range(num // per_chunk)]


def token_budget_rows(lengths: List[int], max_tokens: int, dp: int, dp_rank: int) -> List[torch.Tensor]:
    """This DP rank's micro-batches under a token budget (verl's ``use_dynamic_bsz``): its contiguous
    share of the rows, cut in order into runs whose real tokens (prompt + response) stay within
    ``max_tokens`` (a longer sequence alone), so the micro-batches differ in size."""
    share = len(lengths) // dp
    groups, current, used = [], [], 0
    for row in range(dp_rank * share, (dp_rank + 1) * share):
        if current and used + lengths[row] > max_tokens:
            groups.append(torch.tensor(current))
            current, used = [], 0
        current.append(row)
        used += lengths[row]
    if current:
        groups.append(torch.tensor(current))
    return groups


class Pass:
    """One call of megatron's schedule over rows of ``batch``: the data iterator (each micro-batch;
    under CP this rank's two chunks of every sequence, as Megatron's get_batch_on_this_cp_rank: the
    mask keeps the chunks' query rows over every key), the forward step, and what the loss function
    records -- each micro-batch's per-token values by global row, the CP chunks put back in sequence
    order (moved, not summed). ``extra``: (N, s) tensors handed to the loss function by row.
    Subclasses give ``forward_step``."""

    def __init__(self, batch: ScoringBatch, extra: Optional[Dict[str, torch.Tensor]] = None):
        self.batch, self.extra = batch, extra or {}
        self.rows: Dict[int, torch.Tensor] = {}

    def data(self, rows_per_micro: List[torch.Tensor]):
        device = _device
        s = self.batch.tokens.shape[1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s)
        _, size, rank = cp_state()
        cols = local_columns(s, size, rank)
        mask = mask[:, :, cols.to(device)]
        for rows in rows_per_micro:
            yield dict(rows=rows, sub=self.batch.select(rows), tokens=self.batch.tokens[rows][:, cols].to(device),
                       targets=self.batch.targets[rows][:, cols].to(device),
                       loss_mask=self.batch.scored[rows][:, cols].float().to(device),
                       position_ids=cols.to(device).unsqueeze(0).expand(len(rows), cols.numel()),
                       attention_mask=mask, **{k: v[rows][:, cols].to(device) for k, v in self.extra.items()})

    def forward_step(self, data_iterator, model):
        raise NotImplementedError

    def record(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """(micro-batch, local s) per-token values of ``rows``, kept by global row in sequence order."""
        group, size, _ = cp_state()
        full = gather_columns(values.detach().cpu(), self.batch.tokens.shape[1], group, size)
        for i, row in enumerate(rows.tolist()):
            self.rows[row] = full[i]

    def run(self, forward_backward, wrapped, rows_per_micro: List[torch.Tensor], micro_batch_size: int,
            forward_only: bool) -> None:
        """One schedule call over ``rows_per_micro`` with the DDP-wrapped chunks ``wrapped``."""
        s = self.batch.tokens.shape[1]
        iterators = [self.data(rows_per_micro) for _ in wrapped]
        forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=wrapped if len(wrapped) > 1 else wrapped[0],
            num_microbatches=len(rows_per_micro), seq_length=s, micro_batch_size=micro_batch_size,
            decoder_seq_length=s, forward_only=forward_only,
        )

    def gathered(self) -> torch.Tensor:
        """(N, s) what was recorded, on every rank (``gather_rows``)."""
        return gather_rows(self.rows, self.batch)


def gather_rows(rows: Dict[int, torch.Tensor], batch: ScoringBatch) -> torch.Tensor:
    """(G, s) per-token values (a loss function's, by global row) on every rank: the rows move from
    the rank that computed them (last pipeline stage, TP and CP rank 0, its DP rank) by an all-gather;
    nothing is summed."""
    from megatron.core import parallel_state as ps

    g, s = batch.tokens.shape
    mine = torch.zeros(g, s)
    owned = torch.zeros(g, dtype=torch.int64)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0 \
            and ps.get_context_parallel_rank() == 0:  # CP ranks hold the same gathered rows
        for row, values in rows.items():
            mine[row], owned[row] = values, 1
    everyone = gather_along_rank(mine, dist.group.WORLD)          # (W, G, s)
    owners = gather_along_rank(owned, dist.group.WORLD)           # (W, G)
    if not torch.all(owners.sum(0) == 1):
        raise RuntimeError(f"each sequence must have exactly one owner rank, got {owners.sum(0).tolist()}")
    return everyone[owners.argmax(0), torch.arange(g)]
