"""The gradient-clipping norm from an exact, order-independent sum of squares.

Megatron sums each rank's squared norms in fp32 and all-reduces them over the model-parallel (and,
with the distributed optimizer, data-parallel) ranks: the order follows the layout, and so do the
norm's bits and the clip coefficient. Here every fp32 gradient element's square is formed exactly in
float64 (48 significant bits), read off its bits as significand s (53-bit integer) and biased
exponent e, and s -- split into two 26-bit halves -- goes to the accumulator of e. Within a chunk of
2^16 elements the halves are summed per exponent as float64 (integers below 2^43: exact in any
order), then added to int64 accumulators; integer sums are exact and associative, so the collective
library may add the ranks' accumulators in any order. The total is formed once, exactly, as a Python
integer and rounded once.
"""
import math
from typing import List, Optional

import torch
import torch.distributed as dist

_BINS = 2048  # biased float64 exponents; 0 holds only zeros, 2047 the non-finite squares
_HALF = 26
_MASK = (1 << _HALF) - 1
# Elements per pass: cache-sized (measured fastest on CPU) and the per-exponent float64 sums exact.
_CHUNK = 1 << 16


def exponent_sums(grads: List[torch.Tensor]) -> torch.Tensor:
    """int64 (2, bins): per biased exponent of g^2 the sums of the high and low halves of its
    significand (bin 2047: inf/nan, bin 0: zeros)."""
    acc = torch.zeros(2, _BINS, dtype=torch.int64)
    for g in grads:
        whole = g.detach().reshape(-1)
        for start in range(0, whole.numel(), _CHUNK):
            _add_chunk(acc, whole[start:start + _CHUNK].cpu())
    return acc


def _add_chunk(acc: torch.Tensor, chunk: torch.Tensor) -> None:
    square = chunk.double()
    square.mul_(square)  # exact: an fp32 significand squared fits float64's
    bits = square.view(torch.int64)
    exponent = bits >> 52
    significand = (bits & ((1 << 52) - 1)) | (1 << 52)
    acc[0] += torch.bincount(exponent, weights=(significand >> _HALF).double(), minlength=_BINS).long()
    acc[1] += torch.bincount(exponent, weights=(significand & _MASK).double(), minlength=_BINS).long()


def exact_sum_of_squares(acc: torch.Tensor) -> float:
    """The total of the accumulators, rounded once to fp64 (nan if any element was not finite)."""
    if int(acc[0, _BINS - 1]) or int(acc[1, _BINS - 1]):
        return float("nan")
    total = 0
    for e in range(1, _BINS - 1):  # bin 0: zeros (their implicit bit is not real)
        hi, lo = int(acc[0, e]), int(acc[1, e])
        if hi or lo:
            total += ((hi << _HALF) + lo) << (e - 1)  # s * 2^(e - 1075), relative to 2^(1 - 1075)
    return total / (1 << 1074) if total else 0.0


def grad_norm(grads, group: Optional[dist.ProcessGroup], device) -> float:
    """L2 norm of ``grads`` over every rank of ``group`` (None: this rank alone)."""
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    acc = exponent_sums(list(grads)).to(device)
    if group is not None and dist.get_world_size(group=group) > 1:
        dist.all_reduce(acc, group=group)
    return math.sqrt(exact_sum_of_squares(acc.cpu()))
