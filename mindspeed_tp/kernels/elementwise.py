"""Transcendental elementwise ops whose every element takes one code path, whatever the tensor's
shape or how many threads run it (CPU).

ATen's CPU elementwise loops (``cpu_kernel_vec``) compute each contiguous run of elements two
vectors at a time and the run's last ``run mod 2*lanes`` elements with the op's scalar code, and
the two give other bits for silu, sigmoid and silu's backward (fp32, measured on AVX-512 and AVX2;
rsqrt in bf16; ``tests/test_elementwise_invariance.py`` names the ops and the CPU). A run is a row
of a strided view (megatron's ``torch.chunk`` of fc1's output), a whole contiguous tensor, or one
thread's share of it (ATen cuts a range above its grain size at offsets that follow the thread
count), so an element's bits would depend on the shard width (TP), the tokens per rank (SP, CP, PP,
a decode step) and the thread count. Here such an op reads a contiguous buffer whose length is a
multiple of ``RUN`` (zero-padded at the end), cut into pieces of whole multiples of ``RUN``, each
computed by a thread with one intra-op thread (``one_thread_pieces``): every piece is one run with
no tail, so every element is computed by the vector code, the same bits in every layout, under any
thread count, in training, in the reference engine and in the backward. (exp, log, sin and cos are
computed by ATen's vector code with a masked or partial-vector tail; they go through here too, so no
op relies on that.)

Other devices: a CUDA elementwise kernel computes every element with the same device function, so
the tensor is handed to the op as it is (the GPU device check compares layouts and the rollout).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import one_thread_pieces

# Elements per run, a multiple of every ATen CPU loop step: two vectors of the narrowest dtype at the
# widest vector ATen builds for (2 x 512 bits of bf16 = 64 elements); it divides the projections of
# real models, so their columns need no padding here.
RUN = 128


def loop_step(dtype: torch.dtype) -> int:
    """Elements ATen's vectorized CPU loop computes per step on this host (two vectors of ``dtype``),
    from the CPU capability torch selected (AVX512, AVX2, SVE256, DEFAULT ...)."""
    capability = torch.backends.cpu.get_cpu_capability()
    digits = "".join(ch for ch in capability if ch.isdigit())
    bits = 512 if capability.startswith("AVX512") else int(digits) if digits and int(digits) >= 128 else 256
    return 2 * bits // 8 // torch.empty((), dtype=dtype).element_size()


# Elements one piece holds at least: a piece costs a hand-off to a worker thread, worth it only for
# work of this size (a multiple of RUN; ATen's own grain size).
PIECE = 32768


def _pieces(length: int, threads: int):
    """[start, stop) pieces of a ``length``-element run (a multiple of RUN): whole multiples of RUN,
    at most ``threads`` of them, none under PIECE elements but the last; where the cuts fall changes no
    bit (each piece has no tail), only how the work is shared."""
    size = max(PIECE, -(-length // threads // RUN) * RUN)
    return [(start, min(length, start + size)) for start in range(0, length, size)]


def _padded_flat(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` as one contiguous run of ``length`` elements (its own, then zeros): no copy when it
    already is one."""
    n = x.numel()
    if n == length and x.is_contiguous():
        return x.reshape(-1)
    buf = x.new_zeros(length)
    buf[:n].view(x.shape).copy_(x)
    return buf


def on_whole_runs(op: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``op(*tensors)`` for an elementwise ``op`` over tensors of one shape, every element by the
    op's vector code (see the module docstring). Not differentiable: the ops below wrap it."""
    x = tensors[0]
    if x.device.type != "cpu":
        return op(*tensors)
    if any(t.shape != x.shape for t in tensors):
        raise ValueError(f"on_whole_runs: tensors of one shape expected, got {[tuple(t.shape) for t in tensors]}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("on_whole_runs is not differentiable: use the ops below (silu, sigmoid, exp, log), "
                           "whose backward runs on whole runs too")
    n = x.numel()
    length = max(RUN, -(-n // RUN) * RUN)
    flats = [_padded_flat(t, length) for t in tensors]
    pieces = _pieces(length, one_thread_pieces.threads())
    outs = one_thread_pieces.map_pieces(lambda p: op(*(f[p[0]:p[1]] for f in flats)), pieces)
    # One piece is the output; pieces an in-place op (Tensor.exp_) wrote are the first buffer already.
    in_place = all(o.data_ptr() == flats[0][a].data_ptr() for o, (a, _) in zip(outs, pieces))
    out = outs[0] if len(outs) == 1 else flats[0] if in_place else torch.cat(outs)
    return out[:n].view(x.shape)


class _OnWholeRuns(torch.autograd.Function):
    """``op`` on whole runs, its gradient by ``grad_of(grad, saved)``, ``saved`` the input or the
    output as the gradient needs (one tensor kept, as autograd keeps for the ATen op)."""

    @staticmethod
    def forward(ctx, x, op, grad_of, keeps_output):
        y = on_whole_runs(op, x)
        ctx.save_for_backward(y if keeps_output else x)
        ctx.grad_of = grad_of
        return y

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        return ctx.grad_of(grad.to(saved.dtype), saved), None, None, None


def _by_aten(backward_op):
    """The gradient by ATen's own backward kernel, itself on whole runs (its scalar tail differs too)."""
    return lambda grad, saved: on_whole_runs(backward_op, grad, saved)


_SILU_GRAD = _by_aten(torch.ops.aten.silu_backward)         # of the input
_SIGMOID_GRAD = _by_aten(torch.ops.aten.sigmoid_backward)   # of the output


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu(x) (in the op's precision: fp32 math, one rounding), forward and backward by the vector
    code at every position."""
    return _OnWholeRuns.apply(x, F.silu, _SILU_GRAD, False)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _OnWholeRuns.apply(x, torch.sigmoid, _SIGMOID_GRAD, True)


def exp(x: torch.Tensor) -> torch.Tensor:
    # The gradient is one IEEE multiply (grad * exp(x)): the same bits in vector and scalar code.
    return _OnWholeRuns.apply(x, torch.exp, torch.mul, True)


def log(x: torch.Tensor) -> torch.Tensor:
    # The gradient is one IEEE division (grad / x).
    return _OnWholeRuns.apply(x, torch.log, torch.div, False)


def cos(x: torch.Tensor) -> torch.Tensor:
    """torch.cos on whole runs (RoPE's angles; no gradient: angles are positions, not parameters)."""
    return on_whole_runs(torch.cos, x)


def sin(x: torch.Tensor) -> torch.Tensor:
    return on_whole_runs(torch.sin, x)


QUICK_GELU_SLOPE = 1.702  # megatron's quick_gelu (fusions/fused_bias_geglu.py) and gpt-oss' alpha


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """megatron's quick_gelu, x * sigmoid(1.702 * x), op by op in x's dtype, the sigmoid on whole runs
    (the scaling and the product are one IEEE multiply each)."""
    return x * sigmoid(QUICK_GELU_SLOPE * x)


ACTIVATIONS = {"silu": silu, "quick_gelu": quick_gelu}


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", clamp=None, offset: float = 0.0) -> torch.Tensor:
    """megatron's unfused gated linear unit (MLP.glu, the experts' glu), op by op: with ``clamp``
    (activation_func_clamp_value) the gate clamped above at it and up into [-clamp, clamp] (exact);
    ``activation(gate) * (up + offset)`` (glu_linear_offset; gpt-oss' clamped quick-GEGLU is
    quick_gelu, 7, 1). Offset 0 multiplies by up itself: SwiGLU's bits as the engines compute them
    (megatron's ``up + 0.0`` differs only in a zero's sign)."""
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    if offset:
        up = up + offset
    return ACTIVATIONS[activation](gate) * up


def gated_linear_unit(x: torch.Tensor, activation: str = "silu", clamp=None, offset: float = 0.0) -> torch.Tensor:
    """``glu`` of a gated fc1's output [gate; up] (last dim)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return glu(gate, up, activation, clamp, offset)
