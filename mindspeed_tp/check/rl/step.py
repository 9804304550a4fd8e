"""One RL step's two passes through megatron-core's schedules (``get_forward_backward_func``):

- ``forward_logprobs``: the forward-only pass an RL trainer makes for the current policy's
  logprobs (verl's ``compute_log_prob``), at its own micro-batch size (``--logprob-micro-batch-size``)
  or with micro-batches of varying size cut by a token budget (``--logprob-max-tokens``, as verl's
  ``use_dynamic_bsz``): batch invariance means the split does not matter;
- ``train_step``: the forward-backward of verl's clipped policy loss with the rollout's logprobs as
  the old ones, then the optimizer step.

Logprobs come from the logits as the checker computes them (``harness._logprobs_from_logits``:
megatron's ``vocab_parallel_cross_entropy``, padded vocab columns excluded in both arms, logits /
T at a sampling temperature T); a real-engine profile scores each micro-batch's prompts as the
engine's prefill and the responses as its decode steps (``harness._engine_scoring``).
"""
from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional

import torch

from ..batch import ScoringBatch
from ..harness import _engine_scoring, _logprobs_from_logits, run_device
from ..train.loop import gather_rows


def _sub_batch(batch: ScoringBatch, rows: torch.Tensor) -> ScoringBatch:
    idx = rows.tolist()
    return ScoringBatch(tokens=batch.tokens[rows], lengths=[batch.lengths[i] for i in idx],
                        score_mask=batch.scored[rows], prompt_lens=[batch.prompt_lens[i] for i in idx])


class Pass:
    """What one pass needs in its forward step and loss function, and what it records (each
    micro-batch's per-token logprobs, by global row)."""

    def __init__(self, spec, profile, vanilla: bool, temperature: float, batch: ScoringBatch, extra=None,
                 loss=None):
        self.spec, self.profile, self.vanilla, self.temperature = spec, profile, vanilla, temperature
        self.batch, self.extra, self.loss = batch, extra or {}, loss
        self.rows: Dict[int, torch.Tensor] = {}

    def data(self, rows_per_micro: List[torch.Tensor]):
        device = run_device()
        s = self.batch.tokens.shape[1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s)
        for rows in rows_per_micro:
            sub = _sub_batch(self.batch, rows)
            yield dict(rows=rows, sub=sub, tokens=sub.tokens.to(device), targets=sub.targets.to(device),
                       position_ids=torch.arange(s, device=device).unsqueeze(0).expand(len(rows), s),
                       attention_mask=mask, **{k: v[rows].to(device) for k, v in self.extra.items()})

    def scoring(self, sub: ScoringBatch):
        return _engine_scoring(self.profile, self.vanilla, sub, self.spec)

    def forward_step(self, data_iterator, model):
        data = next(data_iterator)
        with self.scoring(data["sub"]):
            logits = model(data["tokens"], data["position_ids"], data["attention_mask"])
        return logits, partial(self.loss_func, data)

    def loss_func(self, data, logits):
        with self.scoring(data["sub"]):
            logprobs = _logprobs_from_logits(logits, data["sub"], self.spec.vocab_size, self.temperature,
                                             data["targets"]).float()
        for i, row in enumerate(data["rows"].tolist()):
            self.rows[row] = logprobs[i].detach().cpu()
        mask = data["sub"].scored.to(logprobs.device)
        tokens = mask.sum().to(torch.int)
        if self.loss is None:  # forward only: nothing to reduce
            zero = logprobs.new_zeros(())
            return zero, tokens, {}
        loss = self.loss(data["old_logprobs"], logprobs, data["advantages"], mask)
        return loss, tokens, {"policy loss": torch.stack([loss.detach(), tokens.float()])}


def _schedule(forward_backward, wrapped, p: Pass, rows_per_micro, seq_length: int, micro_batch_size: int,
              forward_only: bool) -> None:
    iterators = [p.data(rows_per_micro) for _ in wrapped]
    forward_backward(
        forward_step_func=p.forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=wrapped if len(wrapped) > 1 else wrapped[0],
        num_microbatches=len(rows_per_micro), seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=seq_length, forward_only=forward_only,
    )


def _run(forward_backward, wrapped, p: Pass, rows_per_micro, seq_length: int, micro_batch_size: int,
         forward_only: bool):
    _schedule(forward_backward, wrapped, p, rows_per_micro, seq_length, micro_batch_size, forward_only)
    return gather_rows(p.rows, p.batch)


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


def micro_rows(num: int, micro_batch_size: int, dp: int, dp_rank: int) -> List[torch.Tensor]:
    """This DP rank's rows of each micro-batch, as Megatron's pretraining sampler deals them
    (``train.loop.micro_batch_rows``)."""
    per_chunk = micro_batch_size * dp
    return [torch.arange(i * per_chunk + dp_rank * micro_batch_size, i * per_chunk + (dp_rank + 1) * micro_batch_size)
            for i in range(num // per_chunk)]


def forward_logprobs(forward_backward, wrapped, spec, profile, vanilla, temperature, batch, layout,
                     micro_batch_size: int, max_tokens: Optional[int] = None) -> torch.Tensor:
    """(N, s) logprobs of the current weights on every rank, from a forward-only pass: micro-batches
    of ``micro_batch_size`` sequences, or under a token budget ``max_tokens`` (``token_budget_rows``;
    one schedule call per micro-batch, since a pipeline's shapes are fixed per call)."""
    from megatron.core import parallel_state as ps

    for m in wrapped:
        m.eval()
    try:
        p = Pass(spec, profile, vanilla, temperature, batch)
        s = batch.tokens.shape[1]
        with torch.no_grad():
            if max_tokens is None:
                rows = micro_rows(batch.tokens.shape[0], micro_batch_size, layout.dp, ps.get_data_parallel_rank())
                return _run(forward_backward, wrapped, p, rows, s, micro_batch_size, True)
            for rows in token_budget_rows(list(batch.lengths), max_tokens, layout.dp, ps.get_data_parallel_rank()):
                _schedule(forward_backward, wrapped, p, [rows], s, len(rows), True)
            return gather_rows(p.rows, p.batch)
    finally:
        for m in wrapped:
            m.train()


def train_step(forward_backward, wrapped, optimizer, spec, profile, vanilla, temperature, batch, layout,
               micro_batch_size: int, old_logprobs, advantages, loss) -> torch.Tensor:
    """Zero the gradients, forward-backward the policy loss, step the optimizer; returns the
    in-step logprobs (N, s) on every rank (the policy the loss's ratio was taken against)."""
    from megatron.core import parallel_state as ps

    for m in wrapped:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    p = Pass(spec, profile, vanilla, temperature, batch, dict(old_logprobs=old_logprobs, advantages=advantages),
             loss=loss)
    rows = micro_rows(batch.tokens.shape[0], micro_batch_size, layout.dp, ps.get_data_parallel_rank())
    logprobs = _run(forward_backward, wrapped, p, rows, batch.tokens.shape[1], micro_batch_size, False)
    optimizer.step()
    return logprobs
