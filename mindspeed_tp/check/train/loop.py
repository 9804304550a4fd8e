"""K optimizer steps in one layout, through megatron-core's own training machinery only.

What runs is what a Megatron training script runs: ``DistributedDataParallel`` (buckets,
``overlap_grad_reduce``), ``get_megatron_optimizer`` (Adam, optionally the distributed optimizer with
``overlap_param_gather``), ``get_forward_backward_func()`` (no pipelining, 1F1B, interleaved),
``finalize_model_grads``, and the loss from ``GPTModel.forward(labels=...)``, driven by ``check/driver.py``
(the data iterator and the schedule call are its ``Pass``). This module is only the training script
around them (the loss function, the step loop, what is recorded).

The reported loss is reduced in a layout-independent order (see ``global_loss``): megatron's
per-token losses (``vocab_parallel_cross_entropy``, bitwise under the patches) are moved, never
summed, to every rank, then summed per sequence and over the global batch in one fixed shape. The
usual reduction -- a sum per micro-batch, accumulated over each rank's micro-batches, then an
all-reduce over DP -- adds the same numbers in an order that depends on the micro-batch count per
rank and on the DP size, so it is not bitwise across layouts even when every token's loss is.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ... import disable, enable
from ...models.layout import Layout
from ...models.spec import ModelSpec
from .. import hooks
from .state_file import checkpoint_path, load_state, prune_checkpoints, save_state
from .snapshots import (OPTIMIZER_STATE_KEYS, ShardComparison, optimizer_states, params_of, reduced_main_grads,
                        state_values)
from ...contract.profile import Profile
from ..batch import ScoringBatch, make_batch
from ..driver import (Pass, build_ddp_chunks, make_optimizer, micro_batch_rows, release_models, setup_parallel_state,
                      wire_config)
from ..settings import TrainSettings


def train_batch(spec: ModelSpec, settings: TrainSettings) -> ScoringBatch:
    """The global batch every step trains on (sequences of different lengths, right-padded)."""
    return make_batch(spec.vocab_size, settings.seed, settings.global_batch_size, settings.seq_length)


class LossPass(Pass):
    """The forward-backward of a training step: megatron's loss from ``GPTModel.forward(labels=...)``
    (per-token losses), recorded by global row, and what the schedule expects for per-token loss
    scaling: this rank's sum and token count, which megatron's schedule and finalize_model_grads
    reduce over the DP x CP group."""

    def forward_step(self, data_iterator, model, checkpoint_activations_microbatch=None):
        # the third argument: what megatron's schedule passes with num_microbatches_with_partial_activation_
        # checkpoints set, for a user's step to forward; GPTModel has no such argument
        data = next(data_iterator)
        output = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["targets"])
        return output, lambda output_tensor: self.loss_func(data, output_tensor)

    def loss_func(self, data, output_tensor: torch.Tensor):
        losses = output_tensor.float()  # (b, s)
        self.record(data["rows"], losses)
        loss_mask = data["loss_mask"]
        total = (losses * loss_mask).sum()
        num_tokens = loss_mask.sum().to(torch.int)
        return total, num_tokens, {"lm loss": torch.stack([total.detach(), num_tokens.float()])}


def global_loss(losses: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Mean loss over the scored tokens of the global batch, in one fixed order: each sequence's
    sum over its full (padded) length, then the sum over sequences, divided by the token count.
    The tensors have the same shape in every layout, so the sums are the same additions."""
    per_sequence = (losses * scored.float()).sum(dim=1)
    return per_sequence.sum() / scored.sum().float()


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
    setup_parallel_state(layout, settings.seed, training=True)
    batch = train_batch(spec, settings)
    chunks, wrapped, ddp_config = build_ddp_chunks(spec, layout, dtype, profile, settings)
    optimizer = make_optimizer(wrapped, dtype, settings)
    steps_before = load_state(load_state_path, spec, layout, chunks, optimizer) if load_state_path else 0
    wire_config(chunks[0].config, wrapped, ddp_config, optimizer)
    compare = ShardComparison(spec, layout, chunks)
    rows = micro_batch_rows(settings.global_batch_size, settings.micro_batch_size, layout.dp,
                            ps.get_data_parallel_rank())
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
        step_pass = LossPass(batch)
        step_pass.run(forward_backward, wrapped, rows, settings.micro_batch_size, forward_only=False)
        record("grads", step, reduced_main_grads(wrapped))
        if step > 0:  # with overlap_param_gather, last step's update reached the params in this forward
            record_after_step(step - 1)
        _, grad_norm, _ = optimizer.step()
        per_token = step_pass.gathered()
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
