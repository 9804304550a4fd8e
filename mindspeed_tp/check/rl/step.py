"""One RL step's two passes through megatron-core's schedules (the driver's ``Pass``):

- ``forward_logprobs``: the forward-only pass an RL trainer makes for the current policy's
  logprobs (verl's ``compute_log_prob``), at its own micro-batch size (``--logprob-micro-batch-size``)
  or with micro-batches of varying size cut by a token budget (``--logprob-max-tokens``, as verl's
  ``use_dynamic_bsz``): batch invariance means the split does not matter;
- ``train_step``: the forward-backward of verl's clipped policy loss with the rollout's logprobs as
  the old ones, then the optimizer step.

Logprobs come from the logits as the checker computes them (``driver.logprobs_from_logits``:
megatron's ``vocab_parallel_cross_entropy``, padded vocab columns excluded in both arms, of the
loop's logprob semantics: logits / T, and under processed semantics the top-k / top-p mask); a real-engine profile scores each micro-batch's prompts as the
engine's prefill and the responses as its decode steps (``driver.engine_scoring``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..batch import ScoringBatch
from ..driver import Pass, engine_scoring, logprobs_from_logits, micro_batch_rows, token_budget_rows


class LogprobPass(Pass):
    """Logits from the model, per-token logprobs from them (recorded by global row), and with
    ``loss`` the policy loss of them (``extra``: the old logprobs and the advantages)."""

    def __init__(self, spec, profile, vanilla: bool, sampling, batch: ScoringBatch, extra=None,
                 loss=None):
        super().__init__(batch, extra)
        self.spec, self.profile, self.vanilla, self.sampling, self.loss = spec, profile, vanilla, sampling, loss

    def scoring(self, sub: ScoringBatch):
        return engine_scoring(self.profile, self.vanilla, sub, self.spec)

    def forward_step(self, data_iterator, model):
        data = next(data_iterator)
        with self.scoring(data["sub"]):
            logits = model(data["tokens"], data["position_ids"], data["attention_mask"])
        return logits, lambda output_tensor: self.loss_func(data, output_tensor)

    def loss_func(self, data, logits):
        with self.scoring(data["sub"]):
            logprobs = logprobs_from_logits(logits, data["sub"], self.spec.vocab_size, self.sampling,
                                            data["targets"]).float()
        self.record(data["rows"], logprobs)
        mask = data["loss_mask"].bool()
        tokens = mask.sum().to(torch.int)
        if self.loss is None:  # forward only: nothing to reduce
            zero = logprobs.new_zeros(())
            return zero, tokens, {}
        loss = self.loss(data["old_logprobs"], logprobs, data["advantages"], mask)
        return loss, tokens, {"policy loss": torch.stack([loss.detach(), tokens.float()])}


def forward_logprobs(forward_backward, wrapped, spec, profile, vanilla, sampling, batch, layout,
                     micro_batch_size: int, max_tokens: Optional[int] = None) -> torch.Tensor:
    """(N, s) logprobs of the current weights on every rank, from a forward-only pass: micro-batches
    of ``micro_batch_size`` sequences, or under a token budget ``max_tokens`` (``token_budget_rows``;
    one schedule call per micro-batch, since a pipeline's shapes are fixed per call)."""
    from megatron.core import parallel_state as ps

    for m in wrapped:
        m.eval()
    try:
        p = LogprobPass(spec, profile, vanilla, sampling, batch)
        with torch.no_grad():
            if max_tokens is None:
                rows = micro_batch_rows(batch.tokens.shape[0], micro_batch_size, layout.dp,
                                        ps.get_data_parallel_rank())
                p.run(forward_backward, wrapped, rows, micro_batch_size, forward_only=True)
            else:
                for rows in token_budget_rows(list(batch.lengths), max_tokens, layout.dp,
                                              ps.get_data_parallel_rank()):
                    p.run(forward_backward, wrapped, [rows], len(rows), forward_only=True)
        return p.gathered()
    finally:
        for m in wrapped:
            m.train()


def train_step(forward_backward, wrapped, optimizer, spec, profile, vanilla, sampling, batch, layout,
               micro_batch_size: int, old_logprobs, advantages, loss) -> torch.Tensor:
    """Zero the gradients, forward-backward the policy loss, step the optimizer; returns the
    in-step logprobs (N, s) on every rank (the policy the loss's ratio was taken against)."""
    from megatron.core import parallel_state as ps

    for m in wrapped:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    p = LogprobPass(spec, profile, vanilla, sampling, batch, dict(old_logprobs=old_logprobs, advantages=advantages),
                    loss=loss)
    rows = micro_batch_rows(batch.tokens.shape[0], micro_batch_size, layout.dp, ps.get_data_parallel_rank())
    p.run(forward_backward, wrapped, rows, micro_batch_size, forward_only=False)
    logprobs = p.gathered()
    optimizer.step()
    return logprobs
