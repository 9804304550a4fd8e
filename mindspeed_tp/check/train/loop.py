"""K optimizer steps in one layout, through megatron-core's own training machinery only.

What runs is what a Megatron training script runs: ``DistributedDataParallel`` (buckets,
``overlap_grad_reduce``), ``get_megatron_optimizer`` (Adam, optionally the distributed optimizer with
``overlap_param_gather``), ``get_forward_backward_func()`` (no pipelining, 1F1B, interleaved),
``finalize_model_grads``, and the loss from ``GPTModel.forward(labels=...)``. This module is only the
training script around them (data, the loss function, the step loop, what is recorded).

The reported loss is reduced in a layout-independent order (see ``global_loss``): megatron's
per-token losses (``vocab_parallel_cross_entropy``, bitwise under the patches) are moved, never
summed, to every rank, then summed per sequence and over the global batch in one fixed shape. The
usual reduction -- a sum per micro-batch, accumulated over each rank's micro-batches, then an
all-reduce over DP -- adds the same numbers in an order that depends on the micro-batch count per
rank and on the DP size, so it is not bitwise across layouts even when every token's loss is.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ... import disable, enable
from ...kernels.collectives import gather_along_rank
from ..builder import build_gpt_chunks
from ...models.layout import Layout
from ...models.spec import ModelSpec
from ...models.weights import SeededWeights, load_weights
from .. import hooks
from .state_file import checkpoint_path, load_state, prune_checkpoints, save_state
from .snapshots import (OPTIMIZER_STATE_KEYS, ShardComparison, optimizer_states, params_of, reduced_main_grads,
                        state_values)
from ...contract.profile import Profile
from ..batch import ScoringBatch, make_batch
from ..context_parallel import cp_state, gather_columns, local_columns
from ..harness import _setup_parallel_state, run_device

RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 3
    micro_batch_size: int = 2
    global_batch_size: int = 8
    seq_length: int = 64
    lr: float = 3e-3
    distributed_optimizer: bool = False
    overlap: bool = False
    recompute: str = "none"
    dispatcher: str = "alltoall"
    seed: int = 1234

    def to_dict(self):
        return dict(self.__dict__)


def train_batch(spec: ModelSpec, settings: TrainSettings) -> ScoringBatch:
    """The global batch every step trains on (sequences of different lengths, right-padded)."""
    return make_batch(spec.vocab_size, settings.seed, settings.global_batch_size, settings.seq_length)


def micro_batch_rows(settings: TrainSettings, dp: int, dp_rank: int) -> List[torch.Tensor]:
    """Global rows of each micro-batch of this DP rank, as Megatron's pretraining sampler deals them:
    chunk i of mbs*dp sequences, rank d takes rows [d*mbs, (d+1)*mbs) of it."""
    mbs = settings.micro_batch_size
    per_chunk = mbs * dp
    return [torch.arange(i * per_chunk + dp_rank * mbs, i * per_chunk + (dp_rank + 1) * mbs)
            for i in range(settings.global_batch_size // per_chunk)]


class _LossRecorder:
    """The loss function handed to megatron's schedule: keeps each micro-batch's per-token losses
    (by global row) and returns what the schedule expects for per-token loss scaling. Under CP a
    rank holds its two chunks of each sequence: the per-token losses are gathered back into sequence
    order (moved, not summed) to be recorded; the returned sum and token count are this rank's, which
    megatron's schedule and finalize_model_grads reduce over the DP x CP group."""

    def __init__(self, seq_length: int):
        self.rows: Dict[int, torch.Tensor] = {}
        self.seq_length = seq_length

    def loss_func(self, rows: torch.Tensor, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        losses = output_tensor.float()  # (b, s): GPTModel.forward(labels=...) returns per-token losses
        group, size, _ = cp_state()
        full = gather_columns(losses.detach().cpu(), self.seq_length, group, size)
        for i, row in enumerate(rows.tolist()):
            self.rows[row] = full[i]
        total = (losses * loss_mask).sum()
        num_tokens = loss_mask.sum().to(torch.int)
        return total, num_tokens, {"lm loss": torch.stack([total.detach(), num_tokens.float()])}


def _data(batch: ScoringBatch, rows_per_micro: List[torch.Tensor]):
    """Each micro-batch; under CP this rank's two chunks of every sequence (Megatron's
    get_batch_on_this_cp_rank: the mask keeps the chunks' query rows over every key)."""
    device = run_device()
    s = batch.tokens.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s)
    _, size, rank = cp_state()
    cols = local_columns(s, size, rank)
    mask = mask[:, :, cols.to(device)]
    for rows in rows_per_micro:
        yield dict(rows=rows, tokens=batch.tokens[rows][:, cols].to(device),
                   labels=batch.targets[rows][:, cols].to(device),
                   loss_mask=batch.scored[rows][:, cols].float().to(device),
                   position_ids=cols.to(device).unsqueeze(0).expand(len(rows), cols.numel()),
                   attention_mask=mask)


def _forward_step(recorder: _LossRecorder, data_iterator, model):
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"])
    return output, partial(recorder.loss_func, data["rows"], data["loss_mask"])


def global_loss(losses: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Mean loss over the scored tokens of the global batch, in one fixed order: each sequence's
    sum over its full (padded) length, then the sum over sequences, divided by the token count.
    The tensors have the same shape in every layout, so the sums are the same additions."""
    per_sequence = (losses * scored.float()).sum(dim=1)
    return per_sequence.sum() / scored.sum().float()


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
        raise RuntimeError(f"train-check: each sequence must have exactly one owner rank, got {owners.sum(0).tolist()}")
    return everyone[owners.argmax(0), torch.arange(g)]


def model_parallel_chunks(spec, layout, dtype, profile, settings, **config_overrides):
    """The model chunks in megatron's DDP; ``config_overrides``: TransformerConfig fields on top
    (rl-check: pipeline_dtype under a real-engine profile)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    # perform_initialization: what a training run does; it also tags the TP-sharded weights
    # (tensor_model_parallel, partition_dim), which the gradient norm and clipping read. The seeded
    # weights overwrite the values.
    overrides = dict(RECOMPUTE[settings.recompute], calculate_per_token_loss=True, perform_initialization=True,
                     **config_overrides)
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


def train_layout(spec: ModelSpec, layout: Layout, dtype: torch.dtype, profile: Profile, settings: TrainSettings,
                 vanilla: bool, reference: Optional[Dict] = None, load_state_path: Optional[str] = None,
                 save_state_path: Optional[str] = None, checkpoint_dir: Optional[str] = None) -> Dict:
    """Train ``settings.steps`` steps in ``layout``. Returns, identical on every rank:
    ``loss`` (K,), ``logprobs`` (G, s) of step 1 (from inside the training step), ``grad_norm`` (K,),
    and for each of ``params`` (after each step), ``grads`` (the reduced gradients of each step) and
    ``optimizer_state/<key>`` (after each step): the full tensors by name (one-device run, no
    ``reference``), or else ``<field>_diff``: per step (max |diff|, names that differ) against it.
    ``load_state_path`` / ``save_state_path``: start from / write a layout-free state (state_file);
    ``checkpoint_dir``: also write one after every step (the last two kept). ``settings.steps`` steps
    run after the loaded state's. Checker plugins see the point ``after-step-N`` (N counting the
    loaded steps) once step N's checkpoint is complete."""
    from megatron.core import parallel_state as ps

    disable() if vanilla else enable(profile)
    # After enable: a name bound before it would be the unpatched function.
    from megatron.core.pipeline_parallel import get_forward_backward_func
    _setup_parallel_state(layout, settings.seed, training=True)
    batch = train_batch(spec, settings)
    chunks, wrapped, ddp_config = model_parallel_chunks(spec, layout, dtype, profile, settings)
    optimizer = make_optimizer(wrapped, dtype, settings)
    steps_before = load_state(load_state_path, spec, layout, chunks, optimizer) if load_state_path else 0
    wire_config(chunks[0].config, wrapped, ddp_config, optimizer)
    compare = ShardComparison(spec, layout, chunks)
    rows = micro_batch_rows(settings, layout.dp, ps.get_data_parallel_rank())
    forward_backward = get_forward_backward_func()
    losses, grad_norms = [], []
    recorded: Dict[str, List] = {}
    logprobs = None

    def record(field: str, step: int, values) -> None:
        if reference is None:
            recorded.setdefault(field, []).append(compare.snapshot(values))
        else:
            recorded.setdefault(field + "_diff", []).append(compare.compare(values, reference[field][step]))

    def record_after_step(step: int) -> None:  # parameters and optimizer state after step ``step`` (0-based)
        record("params", step, params_of(chunks))
        states = optimizer_states(optimizer, chunks)
        for key in OPTIMIZER_STATE_KEYS:
            record(f"optimizer_state/{key}", step, state_values(states, key))

    for step in range(settings.steps):
        for m in wrapped:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        recorder = _LossRecorder(settings.seq_length)
        iterators = [_data(batch, rows) for _ in wrapped]
        forward_backward(
            forward_step_func=partial(_forward_step, recorder),
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=wrapped if len(wrapped) > 1 else wrapped[0],
            num_microbatches=len(rows), seq_length=settings.seq_length, micro_batch_size=settings.micro_batch_size,
            decoder_seq_length=settings.seq_length, forward_only=False,
        )
        record("grads", step, reduced_main_grads(wrapped))
        if step > 0:  # with overlap_param_gather, last step's update reached the params in this forward
            record_after_step(step - 1)
        _, grad_norm, _ = optimizer.step()
        per_token = gather_rows(recorder.rows, batch)
        if step == 0:
            logprobs = -per_token
        losses.append(global_loss(per_token, batch.scored))
        grad_norms.append(torch.tensor(float(grad_norm), dtype=torch.float32))
        done = steps_before + step + 1
        if checkpoint_dir:
            if ddp_config.overlap_param_gather:
                for m in wrapped:  # the update's parameter all-gather, as before any checkpoint
                    m.start_param_sync(force_sync=True)
            save_state(checkpoint_path(checkpoint_dir, done), spec, layout, profile, chunks, optimizer, done)
            if dist.get_rank() == 0:
                prune_checkpoints(checkpoint_dir)
            dist.barrier()
        hooks.at_point(f"after-step-{done}", dist.get_rank())
    if ddp_config.overlap_param_gather:
        for m in wrapped:  # the last update's parameter all-gather, as before a checkpoint
            m.start_param_sync(force_sync=True)
    record_after_step(settings.steps - 1)
    if save_state_path:
        save_state(save_state_path, spec, layout, profile, chunks, optimizer, steps_before + settings.steps)
    out = dict(loss=torch.stack(losses), logprobs=logprobs, grad_norm=torch.stack(grad_norms), scored=batch.scored)
    out.update(recorded)
    release_models(wrapped, chunks[0].config)
    return out
