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

Non-finite elements propagate as ``torch.linalg.vector_norm`` does: any NaN (whatever its sign bit)
gives NaN, else any inf gives inf. The int64 accumulators never wrap: when one nears 2^62 its bins
are normalised (each unit of bin e is half a unit of bin e + 1, so the excess is carried upwards,
exactly), and before the all-reduce they are normalised far enough that the ranks' sum fits.
"""
import math
from typing import List, Optional

import torch
import torch.distributed as dist

_INF, _NAN = 2047, 2048  # bins of inf and NaN squares
_BINS = 2049  # biased float64 exponents 0..2046 (0 holds only zeros), then inf, NaN
_HALF = 26
_LIMIT = 1 << 62
# A chunk adds below 2^(27 + 16) = 2^43 to an accumulator, so from below 2^60 (a normalisation's
# bound) 2^18 chunks stay below 2^61 + 2^60 < 2^63: normalise that often.
_CHUNKS_PER_NORMALISE = 1 << 18
_MASK = (1 << _HALF) - 1
# Elements per pass: cache-sized (measured fastest on CPU) and the per-exponent float64 sums exact.
_CHUNK = 1 << 16


def exponent_sums(grads: List[torch.Tensor]) -> torch.Tensor:
    """int64 (2, bins): per biased exponent of g^2 the sums of the high and low halves of its
    significand (bin 0: zeros; ``_INF``, ``_NAN``: counts of the non-finite squares)."""
    acc = torch.zeros(2, _BINS, dtype=torch.int64)
    chunks = 0
    for g in grads:
        whole = g.detach().reshape(-1)
        for start in range(0, whole.numel(), _CHUNK):
            _add_chunk(acc, whole[start:start + _CHUNK].cpu())
            chunks += 1
            if chunks == _CHUNKS_PER_NORMALISE:  # no accumulator can pass 2^63 before (no max read per chunk)
                normalise(acc, _LIMIT >> 2)
                chunks = 0
    return acc


def _add_chunk(acc: torch.Tensor, chunk: torch.Tensor) -> None:
    square = chunk.double()
    square.mul_(square)  # exact: an fp32 significand squared fits float64's
    bits = square.view(torch.int64)
    exponent = (bits >> 52) & 0x7FF  # the sign bit of a NaN must not make it negative
    nan = torch.isnan(square)
    exponent = torch.where(nan, _NAN, exponent)
    significand = (bits & ((1 << 52) - 1)) | (1 << 52)
    acc[0] += torch.bincount(exponent, weights=(significand >> _HALF).double(), minlength=_BINS).long()
    acc[1] += torch.bincount(exponent, weights=(significand & _MASK).double(), minlength=_BINS).long()
    acc[:, 0] = 0  # zeros: their implicit bit is not real, and they must not count towards a wrap
    acc[:, _INF:] = (acc[:, _INF:] != 0).long()  # non-finite: only whether any occurred (never wraps)


def normalise(acc: torch.Tensor, bound: int) -> None:
    """In place, the same exact total with every finite accumulator below ``bound``: the low halves
    folded into the high ones, then each bin's excess carried to the next exponent (2 units of bin
    e are 1 unit of bin e + 1)."""
    finite = slice(1, _INF)
    acc[0, finite] += acc[1, finite] >> _HALF
    acc[1, finite] &= _MASK
    while int(acc[0, finite].max()) >= bound:
        hi = acc[0, finite]
        carry = hi >> 1
        if int(carry[-1]):
            raise OverflowError("exact norm: a carry out of the largest float64 exponent")  # unreachable for fp32
        acc[0, finite] = (hi & 1) + torch.cat([carry.new_zeros(1), carry[:-1]])


def exact_sum_of_squares(acc: torch.Tensor) -> float:
    """The total of the accumulators, rounded once to fp64: NaN if any element was NaN, else inf if
    any was infinite (as ``torch.linalg.vector_norm``)."""
    if int(acc[0, _NAN]) or int(acc[1, _NAN]):
        return float("nan")
    if int(acc[0, _INF]) or int(acc[1, _INF]):
        return float("inf")
    total = 0
    for e in range(1, _INF):  # bin 0: zeros
        hi, lo = int(acc[0, e]), int(acc[1, e])
        if hi or lo:
            total += ((hi << _HALF) + lo) << (e - 1)  # s * 2^(e - 1075), relative to 2^(1 - 1075)
    return total / (1 << 1074) if total else 0.0


def grad_norm(grads, group: Optional[dist.ProcessGroup], device) -> float:
    """L2 norm of ``grads`` over every rank of ``group`` (None: this rank alone)."""
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    acc = exponent_sums(list(grads))
    world = dist.get_world_size(group=group) if group is not None else 1
    if world > 1:
        normalise(acc, _LIMIT // world)  # the ranks' sum of every accumulator stays below 2^62
        acc = acc.to(device)
        dist.all_reduce(acc, group=group)
    return math.sqrt(exact_sum_of_squares(acc.cpu()))
