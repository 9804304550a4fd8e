"""The gradient-clipping norm from an exact, order-independent sum of squares.

Megatron sums each rank's squared norms in fp32 and all-reduces them over the model-parallel (and,
with the distributed optimizer, data-parallel) ranks: the order follows the layout, and so do the
norm's bits and the clip coefficient. Here every fp32 gradient element g = m * 2^e (m a 24-bit
integer) contributes m^2, split into two 24-bit halves, to an int64 accumulator of its exponent e.
Integer sums are exact and associative, so the collective library may add the accumulators in any
order; the total is then formed once, exactly, as a Python integer and rounded once to fp64.
"""
import math
from typing import List, Optional

import torch
import torch.distributed as dist

# frexp exponents of finite fp32 values lie in [-148, 128].
_E_MIN, _BINS = -160, 300
_HALF = 24
# Elements per pass: the integer temporaries (about 40 bytes an element) stay bounded.
_CHUNK = 1 << 20


def exponent_sums(grads: List[torch.Tensor]) -> torch.Tensor:
    """int64 (3, bins): per exponent the sums of the high and low halves of m^2; row 2, slot 0
    counts non-finite elements."""
    acc = torch.zeros(3, _BINS, dtype=torch.int64)
    for g in grads:
        whole = g.detach().reshape(-1)
        for start in range(0, whole.numel(), _CHUNK):
            _add_chunk(acc, whole[start:start + _CHUNK].float())
    return acc


def _add_chunk(acc: torch.Tensor, flat: torch.Tensor) -> None:
    finite = torch.isfinite(flat)
    bad = int((~finite).sum())
    if bad:
        acc[2, 0] += bad
        flat = torch.where(finite, flat, torch.zeros_like(flat))
    mantissa, exponent = torch.frexp(flat)
    m = torch.ldexp(mantissa.abs(), torch.tensor(_HALF, dtype=torch.int32)).to(torch.int64)  # exact
    sq = m * m
    idx = (exponent.to(torch.int64) - _E_MIN).cpu()
    acc[0].index_add_(0, idx, (sq >> _HALF).cpu())
    acc[1].index_add_(0, idx, (sq & ((1 << _HALF) - 1)).cpu())


def exact_sum_of_squares(acc: torch.Tensor) -> float:
    """The total of the accumulators, rounded once to fp64 (inf/nan if any element was)."""
    if int(acc[2, 0]):
        return float("nan")
    total, lowest = 0, None
    for i in range(_BINS):
        hi, lo = int(acc[0, i]), int(acc[1, i])
        if hi or lo:
            e = i + _E_MIN
            # m^2 * 2^(2e - 48): shift every bin to the lowest exponent present
            value = (hi << _HALF) + lo
            if lowest is None:
                lowest = 2 * e
            total += value << (2 * e - lowest)
    if lowest is None:
        return 0.0
    scale = lowest - 2 * _HALF
    return float(total << scale) if scale >= 0 else total / (1 << -scale)


def grad_norm(grads, groups: List[Optional[dist.ProcessGroup]], device) -> float:
    """L2 norm of ``grads`` over every rank of ``groups`` (summed over each group in turn)."""
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    acc = exponent_sums(list(grads)).to(device)
    for group in groups:
        if group is not None and dist.get_world_size(group=group) > 1:
            dist.all_reduce(acc, group=group)
    return math.sqrt(exact_sum_of_squares(acc.cpu()))
