"""The traps a real vocabulary and long sequences expose (issue: real scale), as specifications:
the exact clipping norm never leaves the gradients' device, the LM head's input gradient at a real
vocabulary's leaf count is bitwise across TP 1/2/4 (and SP), attention's backward at 4k tokens is
bitwise across layouts. Speed lives in benchmarks/scale_bench.py, never asserted here."""
import math
from fractions import Fraction

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import bits_equal, full_tier, run_torchrun

# Tensor methods that copy to the host or read a value there.
HOST_READS = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__}


class HostTransfersRaise(TorchFunctionMode):
    """Any host read of a tensor, or a copy to another device, raises inside this mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise AssertionError(f"host transfer: {func.__name__}")
        if func in (torch.Tensor.to, torch.Tensor.copy_) and args:
            source = args[0]
            target = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
            if target is not None and torch.device(target) != source.device:
                raise AssertionError(f"host transfer: {func.__name__} to {target}")
        return func(*args, **kwargs)


def _exact(tensors):
    return float(sum(Fraction(float(v)) ** 2 for t in tensors for v in t.reshape(-1).tolist()))


def test_the_exact_norm_accumulates_on_the_gradients_device_without_a_host_transfer(monkeypatch):
    """On the meta device (no data: any host read or copy fails) and on CPU inside a mode that makes
    every host read raise, the accumulation runs to its end, periodic normalisation included; only
    the final (2, bins) read leaves the device, and the total is the exact one. The torch operations
    are what a device runs, so the host's C loop is switched off here."""
    from mindspeed_tp.kernels import host_square_sums
    from mindspeed_tp.numerics.bitwise_training import grad_norm as gn

    monkeypatch.setattr(host_square_sums, "library", lambda: None)

    monkeypatch.setattr(gn, "_CHUNK", 64)
    monkeypatch.setattr(gn, "_DEVICE_CHUNK", 64)
    monkeypatch.setattr(gn, "_CHUNKS_PER_NORMALISE", 3)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(300, generator=gen) * 1e-2, torch.randn(7, 11, generator=gen).bfloat16(),
             torch.tensor([float("inf"), 1e-45])]
    meta = gn.exponent_sums([g.to("meta") for g in grads])
    assert meta.device.type == "meta" and meta.dtype == torch.int64
    with HostTransfersRaise():
        acc = gn.exponent_sums(grads[:2])
        with pytest.raises(AssertionError, match="host transfer"):  # the mode does catch a read
            gn.exact_sum_of_squares(acc)
    assert gn.exact_sum_of_squares(acc) == _exact([g.float() for g in grads[:2]])
    assert gn.grad_norm(grads, None, "cpu") == math.inf


def test_the_lm_head_input_gradient_at_a_real_vocabulary_is_bitwise_across_tp_and_sp():
    """Vocab 151936 (9496 leaves of the old 16-row tree; 80 wide leaves now) and a small vocab whose
    last ranks hold only padding of some shards: TP 1, 2, 4, with and without SP, bf16 and fp32, the
    padded rows NaN (never used); the tree also computes dy @ W (a tolerance there: a semantics check)."""
    result = run_torchrun("lm_head_grad.py", 4, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("OK", "BAD"))]
    assert len(lines) == 4 * 4 * 5, result.stdout[-3000:]  # 4 ranks x 4 cases x (1 + 2 TPs x 2)
    assert all(line.startswith("OK") for line in lines), "\n".join(l for l in lines if l.startswith("BAD"))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=full_tier(
    covered_by="tests/test_scale.py::test_attention_backward_at_4k_tokens_is_bitwise_across_head_shards",
    why="the same blocked backward at 4k tokens in bf16 (its fp32 accumulation is the fp32 case's arithmetic); "
        "fp32 head-shard invariance at small sizes: test_kernels.py")), torch.bfloat16])
def test_attention_backward_at_4k_tokens_is_bitwise_across_head_shards(dtype):
    """4096 tokens, GQA (8 query heads, 2 key/value groups): a TP rank's heads (TP 2 and 4) get the
    gradients the one-device pass gives those heads, bit for bit, the forward too. The backward's key
    extents come from the host arithmetic (no per-tile read), and with explicit positions (packed
    sequences) from one read."""
    from mindspeed_tp.kernels.attention import consistent_attention

    gen = torch.Generator().manual_seed(4)
    s, hq, hkv, d = 4096, 8, 2, 16
    q, k, v = (torch.randn(1, h, s, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    grad = torch.randn(1, hq, s, d, generator=gen).to(dtype)

    def run(qs, ks, vs, gs, positions=None):
        leaves = [t.clone().requires_grad_(True) for t in (qs, ks, vs)]
        out = consistent_attention(*leaves, scale=d ** -0.5, q_positions=positions)
        out.backward(gs)
        return [out.detach()] + [t.grad for t in leaves]

    full = run(q, k, v, grad)
    assert torch.isfinite(full[1]).all() and full[1].abs().sum() > 0
    for tp in (2, 4):
        per_q, per_kv = hq // tp, max(1, hkv // tp)
        for rank in (0, tp - 1):
            kv = slice(rank * per_q // (hq // hkv), rank * per_q // (hq // hkv) + per_kv)
            heads = slice(rank * per_q, (rank + 1) * per_q)
            shard = run(q[:, heads], k[:, kv], v[:, kv], grad[:, heads])
            if tp == 4:  # two ranks share a key/value head: each holds its gradient share of it
                assert bits_equal(shard[0], full[0][:, heads]) and bits_equal(shard[1], full[1][:, heads])
                continue
            want = [full[0][:, heads], full[1][:, heads], full[2][:, kv], full[3][:, kv]]
            assert all(bits_equal(a, b) for a, b in zip(shard, want)), f"tp{tp} rank {rank}"
    explicit = run(q, k, v, grad, positions=torch.arange(s))
    assert all(bits_equal(a, b) for a, b in zip(explicit, full))
