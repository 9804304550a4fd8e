"""Training side of the rollout-layout mode: reproduce a stock rollout engine at TP=R from any
training layout (profile ``reduction: rollout_layout``).

Row-parallel layer: the input is gathered along K (every rank then holds all of K for its rows),
the weight is re-laid out by output columns (``relayout``), and each rank computes the engine's R
partials for its own N/T output columns (``kernels.rollout``); the column blocks are then gathered
(or, with SP, exchanged so each rank keeps its sequence rows). Nothing is summed across ranks.
Logprobs: vocab shards are exchanged in token chunks so each rank holds the whole vocab for a
slice of a chunk's tokens, and one fp32 log-softmax over the full vocab scores them.
"""
import torch

from ...kernels import elementwise
from ...kernels.collectives import (
    all_gather_rows, all_to_all_slots, columns_to_rows, gather_last_dim, group_rank, group_size,
)
from .engine_math import full_vocab_log_softmax, rollout_row_parallel
from .relayout import relaid_weight

# Tokens per exchange when scoring: bounds the full-vocab buffer to (chunk / T) x V per rank.
LOGPROB_CHUNK_TOKENS = 256


def rollout_layout_linear(x: torch.Tensor, weight: torch.Tensor, group, prof, sequence_parallel: bool,
                          replicated_output: bool = True, gemm=None) -> torch.Tensor:
    """Row-parallel ``x @ W.T`` as the rollout engine computes it; x (..., K/T), weight (N, K/T).

    Returns (..., N) (every rank the same), or with ``sequence_parallel`` this rank's 1/T of dim 0.
    gemm: the engine's partial GEMM ``gemm(x, w) -> x @ w.T`` in x's dtype (a real engine's own
    kernel); default the batch-invariant torch reference GEMM.
    replicated_output: every rank's copy of the output receives the full gradient (as after
    Megatron's all-reduce); False when the ranks' copies are used once between them (MoE: one
    expert-TP rank's copy goes back to the token), so backward sums the copies' gradients.
    """
    lead = x.shape[:-1]
    x_full = gather_last_dim(x.reshape(-1, x.shape[-1]), group, replicated_downstream=False)
    y = rollout_row_parallel(x_full, relaid_weight(weight, group), prof, x.dtype, gemm)  # (M, N/T)
    if sequence_parallel:
        y = columns_to_rows(y, group)
        return y.reshape(lead[0] // group_size(group), *lead[1:], y.shape[-1])
    y = gather_last_dim(y, group, replicated_downstream=replicated_output)
    return y.reshape(*lead, y.shape[-1])


class _FullVocabLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, chunk_tokens, log_softmax):
        world, rank = group_size(group), group_rank(group)
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)  # widened to fp32 chunk by chunk: no fp32 copy of the whole shard
        tgt = target.reshape(-1).long()
        n = flat.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=flat.device)
        keep = ctx.needs_input_grad[0]
        saved = []
        for start in range(0, n, chunk_tokens):
            rows = flat[start:start + chunk_tokens].float()
            c = rows.shape[0]
            per = -(-c // world)
            if per * world != c:
                rows = torch.cat([rows, rows.new_zeros(per * world - c, v_local)])
            # Slot s: rank s's vocab shard of my `per` rows -> my rows over the whole vocab.
            mine = all_to_all_slots(rows, group) if world > 1 else rows.unsqueeze(0)
            full = mine.permute(1, 0, 2).reshape(per, world * v_local)
            idx = torch.arange(start + rank * per, start + (rank + 1) * per).clamp(max=n - 1)
            my_t = tgt[idx]
            lsm = log_softmax(full)
            lp = lsm.gather(-1, my_t.unsqueeze(-1)).squeeze(-1)
            gathered = all_gather_rows(lp.unsqueeze(-1), group).reshape(-1) if world > 1 else lp
            out[start:start + c] = gathered[:c]
            if keep:
                saved.append((start, c, per, lsm, my_t))
        ctx.group, ctx.saved, ctx.shape, ctx.dtype = group, saved, logits.shape, logits.dtype
        return out.reshape(target.shape)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        world, rank = group_size(group), group_rank(group)
        v_local = ctx.shape[-1]
        g = grad.reshape(-1).float()
        n = g.shape[0]
        out = g.new_zeros(n, v_local)
        for start, c, per, lsm, my_t in ctx.saved:
            idx = torch.arange(start + rank * per, start + (rank + 1) * per)
            g_mine = torch.where(idx < start + c, g[idx.clamp(max=n - 1)], 0.0)
            d = -elementwise.on_whole_runs(torch.exp, lsm) * g_mine.unsqueeze(-1)
            d.scatter_add_(-1, my_t.unsqueeze(-1), g_mine.unsqueeze(-1))
            blocks = d.reshape(per, world, v_local).permute(1, 0, 2).reshape(world * per, v_local)
            back = all_to_all_slots(blocks, group).reshape(world * per, v_local) if world > 1 else blocks
            out[start:start + c] = back[:c]
        ctx.saved = None
        return out.reshape(ctx.shape).to(ctx.dtype), None, None, None, None


def full_vocab_parallel_logprob(logits: torch.Tensor, target: torch.Tensor, group, chunk_tokens=None,
                                log_softmax=None) -> torch.Tensor:
    """log_softmax(logits over the whole vocab)[target] in fp32; ``logits`` (..., V/T) holds this
    rank's vocab shard, ``target`` (...) global ids; every rank gets every token's logprob.
    log_softmax: rows (n, V) -> fp32 logprobs (n, V) (a real engine's own; default one fp32 log-softmax)."""
    chunk = int(chunk_tokens or LOGPROB_CHUNK_TOKENS)
    return _FullVocabLogprob.apply(logits, target, group, chunk, log_softmax or full_vocab_log_softmax)
