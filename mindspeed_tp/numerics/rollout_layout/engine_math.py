"""What a stock rollout engine computes at tensor-parallel size R (torch reference backend).

Row-parallel layer at engine TP=R: engine rank r computes ``x[:, K_r] @ W[:, K_r].T`` as one
batch-invariant GEMM over its K/R slice, rounds it to its output dtype, and the engine's all-reduce
adds the R partials. Every output column depends only on that column's weight row (the GEMM is
shard-invariant in N), so a training rank can compute the same bits for any subset of output
columns. Log-probabilities: one fp32 log-softmax over the whole vocab per token.
"""
import torch

from ...kernels.linear import invariant_linear

_DTYPES = {"float32": torch.float32}


def _dtype(name: str, activation: torch.dtype) -> torch.dtype:
    return activation if name == "activation" else _DTYPES[name]


def rollout_row_parallel(x: torch.Tensor, weight: torch.Tensor, prof, out_dtype: torch.dtype, gemm=None) -> torch.Tensor:
    """The engine's row-parallel output for the columns ``weight`` holds.

    x: (M, K) with the full K; weight: (N', K) any subset of output columns (full K).
    Partials are rounded to ``rollout_partial_dtype`` and added in ``rollout_allreduce_order``
    (rank order), each addition in ``rollout_allreduce_dtype``; the result is cast to out_dtype.
    gemm: a real engine's partial GEMM ``gemm(x, w)`` (output in x's dtype, = the activation
    dtype); default the batch-invariant torch GEMM.
    """
    r = prof.rollout_tp
    k = x.shape[-1]
    if k % r or weight.shape[-1] != k:
        raise ValueError(f"K={k} (weight K={weight.shape[-1]}) must be the full K and divisible by rollout_tp={r}")
    partial_dtype = _dtype(prof.rollout_partial_dtype, out_dtype)
    add_dtype = _dtype(prof.rollout_allreduce_dtype, out_dtype)
    if gemm is None:
        def gemm(a, w):
            return invariant_linear(a, w, out_dtype=partial_dtype, row_multiple=prof.gemm_row_multiple)
    elif partial_dtype != x.dtype:
        raise ValueError(f"an engine GEMM returns the activation dtype {x.dtype}, the profile rounds partials to {partial_dtype}")
    if r == 1:
        return gemm(x, weight).to(out_dtype)
    kr = k // r
    total = None
    for rank in range(r):  # rank_sequential: ((p0 + p1) + p2) + ...
        cols = slice(rank * kr, (rank + 1) * kr)
        p = gemm(x[..., cols], weight[:, cols])
        total = p.to(add_dtype) if total is None else (total + p.to(add_dtype))
    return total.to(out_dtype)


def full_vocab_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """One fp32 log-softmax over the whole (last) vocab dim, as the engine's sampler computes it.

    Row-invariant (a row's result does not depend on the other rows; tested), so an engine scoring
    one token and training scoring thousands get the same bits.
    """
    return torch.log_softmax(logits.float(), dim=-1)


def masked_log_softmax(log_softmax, mask_rows, vocab_size: int, rows: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of full-vocab rows after ``mask_rows`` (the engine's top-k / top-p) of their
    real columns (the first ``vocab_size``; padding stays as it is)."""
    rows = rows.float()
    vocab = vocab_size or rows.shape[-1]
    kept = mask_rows(rows[..., :vocab].contiguous())
    if vocab < rows.shape[-1]:
        kept = torch.cat([kept, rows[..., vocab:]], dim=-1)
    return log_softmax(kept)


def full_vocab_logprob(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``full_vocab_log_softmax(logits)`` at ``target``: (..., V) -> (...)."""
    return full_vocab_log_softmax(logits).gather(-1, target.long().unsqueeze(-1)).squeeze(-1)
