"""The gradient-clipping norm from an exact, order-independent sum of squares, on the tensors' device.

Megatron sums each rank's squared norms in fp32 and all-reduces them over the model-parallel (and,
with the distributed optimizer, data-parallel) ranks: the order follows the layout, and so do the
norm's bits and the clip coefficient. Here every gradient element g (fp32; bf16 and fp16 widened
exactly) is read off its bits as g = m * 2^(E - 150), m its 24-bit significand and E its biased
exponent (subnormals: E = 1 without the implicit bit), so g^2 = m^2 * 2^(2E - 300) with m^2 < 2^48.
m^2 is split into two 24-bit halves and each goes, by one integer scatter-add, to the int64
accumulator of E. Integer sums are exact and associative: any chunking, any order and the collective
library's all-reduce give the same accumulators. The total is formed once, exactly, as a Python
integer from the (2, bins) accumulators, and rounded once: the correctly rounded fp64 sum of squares.

Everything up to that final read stays on the gradients' device: no host transfer, no host read of a
tensor (tested by a case in which any raises). On the host the accumulation is compiled C
(``kernels/host_square_sums.py``, the same integer sums) in chunks of 2^22 elements; as torch
operations (other devices, or no C compiler) in chunks of 2^16 elements on the host (they stay in
cache) and 2^22 on a device (fewer launches). Non-finite elements
propagate as ``torch.linalg.vector_norm`` does: any NaN (whatever its sign bit) gives NaN, else any
inf gives inf. The accumulators never wrap: an element adds below 2^24 to one, and every 2^32 elements (and before
the all-reduce) they are normalised by a fixed number of exact carries (4 units of bin E are
one unit of bin E + 1), with no host read to decide it; afterwards each is below 2^24.
"""
import math
from typing import List, Optional

import torch
import torch.distributed as dist

from ...kernels import host_square_sums

_HALF = 24
_MASK = (1 << _HALF) - 1
_EXPONENTS = 255  # fp32 biased exponents 0..254 are finite (bin 0 stays empty: subnormals use bin 1)
# Carries move value up one bin per pass; a sum of fewer than 2^50 squares of finite fp32 values
# (< 2^256 each) stays below one unit of bin 254 + 27, so the headroom bins never carry out.
_HEADROOM = 32
_FINITE = _EXPONENTS + _HEADROOM
_INF, _NAN = _FINITE, _FINITE + 1  # whether any square was inf, NaN (0 or 1)
_BINS = _FINITE + 2
_CHUNK = 1 << 16  # torch operations on the host
_DEVICE_CHUNK = 1 << 22  # torch operations on a device
# An element adds below 2^24 to one accumulator, so 2^32 elements add below 2^56; after a
# normalisation every accumulator is below 2^24 (see normalise): they stay below 2^57 < 2^63.
_CHUNKS_PER_NORMALISE = 1 << 16  # of _CHUNK elements: 2^32


def exponent_sums(grads: List[torch.Tensor]) -> torch.Tensor:
    """int64 (2, bins) on the gradients' device: per fp32 exponent E the sums of the high and low
    24-bit halves of m^2 (``_INF``, ``_NAN``: whether any square was inf, NaN)."""
    device = grads[0].device if len(grads) else torch.device("cpu")
    acc = torch.zeros(2, _BINS, dtype=torch.int64, device=device)
    budget = _CHUNK * _CHUNKS_PER_NORMALISE  # elements between normalisations
    lib = host_square_sums.library() if device.type == "cpu" else None
    if lib is not None:
        chunk = min(host_square_sums.MAX_ELEMENTS, budget)
        add = lambda acc, piece: host_square_sums.add_square_sums(lib, acc, piece, _NAN, _INF)  # noqa: E731
    else:
        chunk = _CHUNK if device.type == "cpu" else _DEVICE_CHUNK
        add = _add_chunk
    since = 0
    for g in grads:
        if g.dtype == torch.float64:
            raise TypeError("exact grad norm: float64 gradients are not supported (fp32, bf16 or fp16 expected)")
        whole = g.detach().reshape(-1)
        for start in range(0, whole.numel(), chunk):
            piece = whole[start:start + chunk]
            if since + piece.numel() > budget:
                normalise(acc)
                since = 0
            add(acc, piece.to(device=device, dtype=torch.float32))
            since += piece.numel()
    return acc


def _add_chunk(acc: torch.Tensor, chunk: torch.Tensor) -> None:
    # Few temporaries, most updated in place, on a chunk that stays in cache: the arithmetic is a
    # few integer operations per element, so fresh multi-MB temporaries (page faults) would dominate.
    bits = chunk.contiguous().view(torch.int32)
    exponent = (bits >> 23).bitwise_and_(0xFF)
    fraction = bits & 0x7FFFFF
    special = exponent == 255  # inf (no fraction) or NaN (any fraction, any sign)
    acc[0, _NAN] += (special & (fraction != 0)).sum()
    acc[0, _INF] += (special & (fraction == 0)).sum()
    fraction.masked_fill_(special, 0)
    fraction.bitwise_or_((exponent != 0).to(torch.int32) << 23)  # the implicit bit (not subnormals)
    square = fraction.long()
    square.mul_(square)  # exact: below 2^48; 0 for inf and NaN (counted above)
    bins = exponent.clamp_(1, _EXPONENTS - 1).long()  # subnormals: bin 1
    acc[0].index_add_(0, bins, square >> _HALF)
    acc[1].index_add_(0, bins, square.bitwise_and_(_MASK))


def normalise(acc: torch.Tensor, passes: int = 32) -> None:
    """In place, the same exact total with smaller accumulators: the low halves folded into the high
    ones (then below 2^24), then ``passes`` exact carries of the high ones (4 units of bin E are one of
    bin E + 1, since g^2 scales by 2^(2E)). A fixed count, so no host read decides it: after k passes
    every high accumulator is below 4 + max / 4^k, so below 8 after the default 32 from below 2^63."""
    hi, lo = acc[0, :_FINITE], acc[1, :_FINITE]
    hi += lo >> _HALF
    lo &= _MASK
    for _ in range(passes):
        carry = hi >> 2
        hi.bitwise_and_(3)
        hi[1:] += carry[:-1]
    acc[:, _INF:].clamp_(max=1)  # non-finite: only whether any occurred


def exact_sum_of_squares(acc: torch.Tensor) -> float:
    """The total of the accumulators, rounded once to fp64 (one host read): NaN if any element was
    NaN, else inf if any was infinite (as ``torch.linalg.vector_norm``)."""
    values = acc.tolist()
    if values[0][_NAN] or values[1][_NAN]:
        return float("nan")
    if values[0][_INF] or values[1][_INF]:
        return float("inf")
    total = 0
    for e in range(1, _FINITE):
        hi, lo = values[0][e], values[1][e]
        if hi or lo:
            total += ((hi << _HALF) + lo) << (2 * e)  # (m^2 sums) * 2^(2E), relative to 2^-300
    return total / (1 << 300) if total else 0.0


def square_sums(grads, group: Optional[dist.ProcessGroup], device) -> torch.Tensor:
    """The exact accumulators of ``grads``' squares summed over every rank of ``group`` (None: this
    rank alone); integer sums, so those of several groups add exactly (``norm_of``)."""
    if isinstance(grads, torch.Tensor):
        grads = [grads]
    grads = list(grads)
    acc = exponent_sums(grads) if grads else torch.zeros(2, _BINS, dtype=torch.int64, device=device)
    world = dist.get_world_size(group=group) if group is not None else 1
    if world > 1:
        if world > 1 << 20:
            raise ValueError(f"exact grad norm: {world} ranks; at most 2^20 keep the all-reduced accumulators exact")
        normalise(acc)  # every accumulator below 2^24: the sum over up to 2^20 ranks stays below 2^44
        acc = acc.to(device)
        dist.all_reduce(acc, group=group)
    return acc


def norm_of(acc: torch.Tensor) -> float:
    """The L2 norm from accumulators (one host read)."""
    return math.sqrt(exact_sum_of_squares(acc))


def grad_norm(grads, group: Optional[dist.ProcessGroup], device) -> float:
    """L2 norm of ``grads`` over every rank of ``group`` (None: this rank alone)."""
    return norm_of(square_sums(grads, group, device))
