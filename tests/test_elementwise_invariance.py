"""Elementwise ops on a TP-sharded dimension give an element the same bits whatever the shard width,
the rows computed together and the thread count (kernels/elementwise.py), forward and backward,
fp32 and bf16, on this host's ISA (each assertion names the CPU).

The sweep takes every shard width 1-1024 as the column slice of a megatron-style ``torch.chunk``
view (rows strided by twice the width, as fc1's [gate; up]) and compares each element with the
same element computed in the whole, unsharded tensor, with one row (a decode step), under 1, 2 and
3 threads. ATen's own silu fails it on x86 (its vector loop's scalar tail, measured: fp32 shard
widths not a multiple of 32 on AVX-512); the ops mindspeed-tp runs through kernels/elementwise.py
must pass it, and so must the exact ops it leaves to ATen (multiply, bias add, casts). Those
tensors are below ATen's grain size, where ATen never splits a range between threads; the thread
sweep on tensors of 100k elements splits it (ATen's own silu fails there with 2-4 threads), and
the ops must still give every element the one-thread bits."""
import pytest
import torch
import torch.nn.functional as F

from conftest import bits_equal, host_cpu, torch_threads
from mindspeed_tp.kernels import elementwise

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]
WIDTHS = range(1, 1025)
ROWS = 5
FULL = 1024


def _values(rows, cols, seed, dtype):
    """Normal values times 6 (silu's curved part and both tails), subnormals, signed zeros."""
    x = 6 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    flat = x.view(-1)
    flat[::97] = 1e-40
    flat[5::89] = -1e-39
    flat[7::101] = -0.0
    return x.to(dtype)


def _silu_grad(x, g):
    x = x.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(elementwise.silu(x), x, g)
    return grad


def _sigmoid_grad(x, g):
    x = x.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(elementwise.sigmoid(x), x, g)
    return grad


def _gpt_oss_glu_grads(x, g):
    """The gate's and up's gradients of gpt-oss' clamped quick-GEGLU (its clamp at 7 bites on these values)."""
    a, b = x.detach().requires_grad_(True), g.detach().requires_grad_(True)
    out = elementwise.glu(a, b, "quick_gelu", 7.0, 1.0)
    grad_a, grad_b = torch.autograd.grad(out, (a, b), torch.ones_like(out))
    return torch.stack([grad_a, grad_b], dim=-1)  # (rows, width, 2): sliced by width as the others


# name -> op on (gate, up) views of one shape: what runs on a TP-sharded dimension, forward and backward.
OPS = {
    "swiglu": lambda a, b: elementwise.silu(a) * b,
    "gpt_oss_glu": lambda a, b: elementwise.glu(a, b, "quick_gelu", 7.0, 1.0),
    "gpt_oss_glu_backward": _gpt_oss_glu_grads,
    "silu_backward": _silu_grad,
    "sigmoid": lambda a, b: elementwise.sigmoid(a),
    "sigmoid_backward": _sigmoid_grad,
    "exp": lambda a, b: elementwise.exp(a),
    "log": lambda a, b: elementwise.log(a.abs() + 1),
    "add": lambda a, b: a + b,
    "bias_add": lambda a, b: a + _values(1, max(FULL, a.shape[-1]), 9, a.dtype)[0, :a.shape[-1]],
    "cast_fp32": lambda a, b: a.float(),
    "cast_bf16": lambda a, b: a.to(torch.bfloat16),
}


def _chunk_views(x, width):
    """fc1's output [gate; up] of one rank, ``width`` columns each, as megatron's glu views it."""
    return torch.chunk(x[:, :2 * width], 2, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_elementwise_ops_are_invariant_to_shard_width_rows_and_threads(name, dtype):
    op = OPS[name]
    gate_full = _values(ROWS, FULL, 1, dtype)
    up_full = _values(ROWS, FULL, 2, dtype)
    whole = op(gate_full, up_full)  # the unsharded tensor: every width's columns are its first ones
    bad = []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            for width in WIDTHS:
                both = torch.cat([gate_full[:, :width], up_full[:, :width]], dim=-1)
                gate, up = _chunk_views(both, width)
                if not bits_equal(op(gate, up), whole[:, :width]):
                    bad.append((threads, width, "rows"))
                if width % 97 == 1 and not bits_equal(op(gate[2:3], up[2:3]), whole[2:3, :width]):
                    bad.append((threads, width, "one row"))
    assert not bad, f"{name} {dtype} on {host_cpu()}: {len(bad)} (threads, width) cases differ: {bad[:10]}"


def test_atens_own_silu_is_not_invariant_on_this_host():
    """The premise: ATen's silu on a chunk view gives some element other bits at some shard width
    (the sweep above can fail); fp32, where a scalar-tail difference is never rounded away."""
    gate_full = _values(ROWS, FULL, 1, torch.float32)
    whole = F.silu(gate_full)
    differ = [w for w in range(1, 200) if not bits_equal(
        F.silu(torch.chunk(torch.cat([gate_full[:, :w]] * 2, -1), 2, -1)[0]), whole[:, :w])]
    assert differ, f"ATen's silu is position-invariant on {host_cpu()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_the_run_length_is_a_multiple_of_this_hosts_loop_step(dtype):
    step = elementwise.loop_step(dtype)
    assert step >= 16 and elementwise.RUN % step == 0, (torch.backends.cpu.get_cpu_capability(), step)


# Above ATen's grain size (32768 elements), where ATen cuts a range between its threads: 3 rows of
# 33333 (not a multiple of any thread count's share of whole vector steps).
BIG = (3, 33333)


def test_atens_own_silu_splits_between_threads_above_its_grain_size():
    """The premise of the big-tensor sweep: with 2, 3 or 4 threads ATen's silu gives some element other
    bits than with one (each thread's share ends in a scalar tail), fp32."""
    x = _values(*BIG, 11, torch.float32)
    with torch_threads(1):
        one = F.silu(x)
    differ = []
    for threads in (2, 3, 4):
        with torch_threads(threads):
            differ += [threads] if not bits_equal(F.silu(x), one) else []
    assert differ, f"ATen's silu gives the one-thread bits under 2-4 threads on {host_cpu()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_big_tensors_are_invariant_to_the_thread_count(name, dtype):
    """The ops on tensors ATen would split (and on a chunk view of one), 2-8 threads against 1."""
    op = OPS[name]
    gate, up = _values(*BIG, 12, dtype), _values(*BIG, 13, dtype)
    views = _chunk_views(torch.cat([gate, up], dim=-1), BIG[1])
    with torch_threads(1):
        want = op(gate, up), op(*views)
    bad = []
    for threads in (2, 3, 4, 8):
        with torch_threads(threads):
            got = op(gate, up), op(*views)
        bad += [(threads, kind) for kind, g, w in zip(("whole", "chunk view"), got, want) if not bits_equal(g, w)]
    assert not bad, f"{name} {dtype} on {host_cpu()}: (threads, tensor) cases differ from one thread: {bad}"


@pytest.mark.parametrize("name", ["cos", "sin"])
def test_rope_cos_and_sin_are_invariant_to_rows_and_threads(name):
    """RoPE's cos / sin of the angles (kernels/rope.py): a position's value is the same whether its row
    is computed alone (a decode step), among a few, or in a big tensor under 1-4 threads."""
    op = getattr(elementwise, name)
    angles = torch.arange(40000, dtype=torch.float32).unsqueeze(1) * torch.logspace(0, -4, 64)
    with torch_threads(1):
        whole = op(angles)
    bad = []
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            if not bits_equal(op(angles), whole):
                bad.append((threads, "whole"))
            for rows in (slice(7, 8), slice(100, 117), slice(39990, 40000)):
                if not bits_equal(op(angles[rows]), whole[rows]):
                    bad.append((threads, rows))
    assert not bad, f"{name} on {host_cpu()}: {bad}"


def test_the_callers_thread_count_is_kept_and_inputs_are_not_changed():
    """The workers' one intra-op thread is theirs: the caller's count stays what it was."""
    before = torch.get_num_threads()
    x = _values(*BIG, 3, torch.float32)
    keep = x.clone()
    with torch_threads(2):
        elementwise.silu(x[:, :20000])
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == before and bits_equal(x, keep)


def test_a_torch_whose_workers_cannot_go_to_one_thread_is_refused(monkeypatch):
    """A torch whose set_num_threads does not give a worker thread one intra-op thread (one
    process-wide pool) would leave a call split between threads: refused by name, never computed so."""
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.kernels import one_thread_pieces

    with torch_threads(2):
        monkeypatch.setattr(one_thread_pieces, "_pool", None)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
        with pytest.raises(ConfigError, match="intra-op thread.*OMP_NUM_THREADS=1"):
            elementwise.silu(_values(*BIG, 4, torch.float32))
        monkeypatch.setattr(one_thread_pieces, "_pool", None)  # the next test starts a sound pool
