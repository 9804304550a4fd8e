"""The npu kernel backend without an NPU.

The stand-ins in tests/fakes/npu (torch_npu, batch_invariant_ops, flash_attn_npu,
flash_attn_npu_v3) carry the public signatures of the real packages, record every call and return
plain torch results. The contract tests here prove which op is called with exactly which arguments
(dtypes, layouts, flags) -- the call contract -- and nothing about the numerics of the Ascend
kernels: that needs an NPU (docs/DEVICES.md, "Ascend").
"""
import os
import sys
import types
import warnings

import pytest
import torch

from conftest import ROOT, bits_equal, explain, run_python

FAKES = os.path.join(ROOT, "tests", "fakes", "npu")
FAKE_MODULES = ("torch_npu", "batch_invariant_ops", "flash_attn_npu", "flash_attn_npu_v3", "flash_attn_npu_3")


@pytest.fixture
def npu_stack(monkeypatch):
    """The stand-in Ascend packages importable, the npu backend forced; all undone afterwards."""
    from mindspeed_tp.kernels import dispatch
    from mindspeed_tp.devices import npu_runtime as npu

    monkeypatch.syspath_prepend(FAKES)
    had_npu = hasattr(torch, "npu")
    npu.reset()
    dispatch.select("npu")
    import batch_invariant_ops
    import flash_attn_npu
    import flash_attn_npu_v3

    batch_invariant_ops.CALLS.clear()
    flash_attn_npu.CALLS.clear()
    flash_attn_npu_v3.CALLS.clear()
    yield types.SimpleNamespace(bi=batch_invariant_ops.CALLS, fa=flash_attn_npu.CALLS, fa3=flash_attn_npu_v3.CALLS)
    dispatch.select("auto")
    npu.reset()
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)
    if not had_npu and hasattr(torch, "npu"):
        del torch.npu


def _only(calls, name):
    found = [args for op, args in calls if op == name]
    assert found, f"{name} not called; calls: {[op for op, _ in calls]}"
    return found


def test_import_and_enable_without_torch_npu():
    """No Ascend package installed: import and enable work (torch backend, nothing Ascend
    imported), and asking for the npu backend is a ConfigError naming the missing package."""
    code = (
        "import sys, dataclasses\n"
        "import mindspeed_tp\n"
        "from mindspeed_tp.kernels import dispatch\n"
        "prof = mindspeed_tp.enable()\n"
        "print('ENABLED', mindspeed_tp.is_enabled(), dispatch.selected())\n"
        "print('IMPORTED', [m for m in ('torch_npu', 'batch_invariant_ops', 'flash_attn_npu') if m in sys.modules])\n"
        "try:\n"
        "    mindspeed_tp.enable(dataclasses.replace(prof, backend='npu'))\n"
        "except mindspeed_tp.ConfigError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, explain(proc)
    assert "ENABLED True auto" in proc.stdout
    assert "IMPORTED []" in proc.stdout
    error = proc.stdout.split("ERROR ", 1)[1]
    assert "'torch_npu'" in error and "backend: torch" in error


@pytest.mark.parametrize("hidden, named", [
    (("batch_invariant_ops",), "'batch_invariant_ops'"),
    (("flash_attn_npu",), "'flash_attn_npu'"),
    (("flash_attn_npu_v3", "flash_attn_npu_3"), "'flash_attn_npu_v3'"),
])
def test_missing_piece_is_named(npu_stack, monkeypatch, hidden, named):
    from mindspeed_tp import ConfigError
    from mindspeed_tp.devices import npu_runtime as npu

    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    npu.reset()
    with pytest.raises(ConfigError) as exc:
        npu.load()
    assert named in str(exc.value)


def test_v3_package_under_its_new_name(npu_stack, monkeypatch):
    """flash-attention-npu renamed flash_attn_npu_v3 to flash_attn_npu_3: either is accepted."""
    import flash_attn_npu_v3
    from mindspeed_tp.devices import npu_runtime as npu

    monkeypatch.setitem(sys.modules, "flash_attn_npu_v3", None)
    monkeypatch.setitem(sys.modules, "flash_attn_npu_3", flash_attn_npu_v3)
    npu.reset()
    assert npu.load().flash_attn_with_kvcache is flash_attn_npu_v3.flash_attn_with_kvcache


def test_backend_selection():
    from mindspeed_tp import ConfigError
    from mindspeed_tp.kernels import dispatch

    on_npu = types.SimpleNamespace(device=types.SimpleNamespace(type="npu"))  # what dispatch reads
    on_cpu = torch.zeros(1)
    try:
        dispatch.select("auto")
        assert (dispatch.backend_name(on_npu) == 'npu') and not (dispatch.backend_name(on_cpu) == 'npu')
        dispatch.select("torch")  # its invariance is a CPU BLAS property: npu tensors are refused, not run
        assert dispatch.backend_name(on_cpu) == "torch"
        with pytest.raises(ConfigError, match="backend to auto"):
            dispatch.backend_name(on_npu)
        dispatch.select("npu")
        assert (dispatch.backend_name(on_npu) == 'npu') and (dispatch.backend_name(on_cpu) == 'npu')
        with pytest.raises(ValueError):
            dispatch.select("cuda")
    finally:
        dispatch.select("auto")


def test_auto_prepares_npu_only_when_an_npu_is_present(npu_stack, monkeypatch):
    from mindspeed_tp.kernels import dispatch
    from mindspeed_tp.devices import npu_runtime as npu
    from mindspeed_tp.contract.profile import Profile
    from mindspeed_tp.devices import machine_device_type

    import torch_npu

    monkeypatch.setattr(os, "environ", dict(os.environ))  # set_collective_env writes here
    loads = []
    monkeypatch.setattr(npu, "load", lambda: loads.append(1))
    monkeypatch.setattr(torch_npu, "AVAILABLE", False)
    assert dispatch.prepare(Profile(backend="auto"), machine_device_type()) == "torch" and not loads
    assert dispatch.selected() == "auto"
    monkeypatch.setattr(torch_npu, "AVAILABLE", True)
    assert dispatch.prepare(Profile(backend="auto"), machine_device_type()) == "npu" and loads == [1]
    assert dispatch.prepare(Profile(backend="torch"), machine_device_type()) == "torch" and loads == [1]
    assert dispatch.prepare(Profile(backend="npu"), machine_device_type()) == "npu" and loads == [1, 1]
    assert os.environ["HCCL_DETERMINISTIC"] == "strict" and os.environ["LCCL_DETERMINISTIC"] == "1"


def test_collective_environment():
    from mindspeed_tp.devices.npu_runtime import set_collective_env

    env = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set_collective_env(env) == ["HCCL_DETERMINISTIC", "LCCL_DETERMINISTIC"]
        assert env == {"HCCL_DETERMINISTIC": "strict", "LCCL_DETERMINISTIC": "1"}
        assert set_collective_env(env) == []  # already right: no change, no warning
    env = {"HCCL_DETERMINISTIC": "True", "LCCL_DETERMINISTIC": "1"}
    with pytest.warns(RuntimeWarning, match="HCCL_DETERMINISTIC='True'"):
        assert set_collective_env(env) == ["HCCL_DETERMINISTIC"]
    assert env["HCCL_DETERMINISTIC"] == "strict"


def test_profile_npu_refuses_split_kv():
    from mindspeed_tp import ConfigError
    from mindspeed_tp.contract.profile import Profile

    with pytest.raises(ConfigError, match="attention_split_size"):
        Profile(backend="npu", attention_split_size=256)


def test_linear_contract(npu_stack):
    """invariant_linear: one npu_mm_batch_invariant(x fp32 (M, K), w^T fp32 (K, N)) call, bias
    added in fp32, one cast; its backward calls the same op for both gradients."""
    from mindspeed_tp.kernels import invariant_linear

    x = torch.randn(3, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(24, 16, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(24, dtype=torch.bfloat16)
    out = invariant_linear(x, w, bias)
    (a, b), = _only(npu_stack.bi, "npu_mm_batch_invariant")
    assert a.dtype == b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
    assert bits_equal(a, x.detach().reshape(15, 16).float()) and bits_equal(b, w.detach().float().t())
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 24)
    assert bits_equal(out, (torch.mm(a, b) + bias.float()).to(torch.bfloat16).reshape(3, 5, 24))
    out.float().sum().backward()
    assert len(_only(npu_stack.bi, "npu_mm_batch_invariant")) == 3
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_leaf_partials_contract(npu_stack):
    """Row-parallel leaves: one batched npu_matmul_batch_invariant((L, M, K/L), (L, K/L, N))."""
    from mindspeed_tp.kernels import leaf_partials

    x, w = torch.randn(6, 32), torch.randn(10, 32)
    out = leaf_partials(x, w, 4)
    (a, b), = _only(npu_stack.bi, "npu_matmul_batch_invariant")
    assert a.shape == (4, 6, 8) and b.shape == (4, 8, 10) and a.dtype == torch.float32
    assert bits_equal(a, x.reshape(6, 4, 8).transpose(0, 1)) and out.shape == (4, 6, 10)


def test_reduction_contracts(npu_stack):
    """RMSNorm's mean, the vocab leaves' sums: npu_reduce_sum_batch_invariant(x, last dim as a
    non-negative int, keepdim); the MoE softmax router: npu_log_softmax_batch_invariant(x, 1)."""
    from mindspeed_tp.kernels import rms_norm, vocab_parallel_logprob
    from mindspeed_tp.kernels.moe import route

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    rms_norm(x, torch.ones(16), 1e-6)
    (t, dim, keepdim), = _only(npu_stack.bi, "npu_reduce_sum_batch_invariant")
    assert (dim, keepdim) == (1, True) and t.dtype == torch.float32 and bits_equal(t, x.float().pow(2))
    npu_stack.bi.clear()
    logits = torch.randn(2, 3, 64)
    vocab_parallel_logprob(logits, torch.randint(0, 64, (2, 3)), None, 8)
    (t, dim, keepdim), = _only(npu_stack.bi, "npu_reduce_sum_batch_invariant")
    assert t.shape == (2, 3, 8, 8) and (dim, keepdim) == (3, False)
    npu_stack.bi.clear()
    route(torch.randn(5, 8), 2, "softmax", pre_softmax=True)
    (t, dim), = _only(npu_stack.bi, "npu_log_softmax_batch_invariant")
    assert t.shape == (5, 8) and t.dtype == torch.float32 and dim == 1


def test_attention_contract(npu_stack):
    """Training attention: flash_attn_npu.flash_attn_func on (b, s, h, d) tensors with no dropout,
    window (-1, -1), softcap 0, no ALiBi, deterministic backward; output back in (b, h, s, d)."""
    from mindspeed_tp import ConfigError
    from mindspeed_tp.kernels import consistent_attention

    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    out = consistent_attention(q, k, v, scale=0.25, causal=True)
    call, = npu_stack.fa
    assert {key: call[key] for key in call if key not in ("q", "k", "v")} == {
        "dropout_p": 0.0, "softmax_scale": 0.25, "causal": True, "window_size": (-1, -1), "softcap": 0.0,
        "alibi_slopes": None, "deterministic": True, "return_attn_probs": False}
    assert call["q"].shape == (2, 7, 4, 8) and call["q"].is_contiguous() and bits_equal(call["q"], q.transpose(1, 2))
    assert call["k"].shape == (2, 7, 2, 8) and out.shape == q.shape
    consistent_attention(q, k, v, scale=0.25, causal=False, q_positions=torch.arange(0, 7))
    assert npu_stack.fa[-1]["causal"] is False
    with pytest.raises(ConfigError, match="causal or no-mask"):
        consistent_attention(q, k, v, 0.25, excluded=torch.zeros(1, 1, 7, 7, dtype=torch.bool))
    with pytest.raises(ConfigError, match="attention_split_size"):
        consistent_attention(q, k, v, 0.25, split_size=256)
    with pytest.raises(ConfigError, match="last key positions"):
        consistent_attention(q[:, :, :3], k, v, 0.25, q_positions=torch.arange(0, 3))


def test_decode_contract(npu_stack):
    """Decode: the v3 flash_attn_with_kvcache over the paged cache with num_splits=1, causal,
    window (-1, -1), softcap 0, int32 cache_seqlens and page_table, no LSE returned."""
    from mindspeed_tp.kernels import decode_attention

    k_cache, v_cache = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    page_table = torch.tensor([[3, 1, 0], [5, 2, 4]])
    seqlens = torch.tensor([7, 10])
    q = torch.randn(2, 4, 1, 8)
    out = decode_attention(q, k_cache, v_cache, seqlens, page_table, scale=0.3)
    call, = npu_stack.fa3
    assert (call["num_splits"], call["causal"], call["window_size"], call["softcap"], call["softmax_scale"],
            call["return_softmax_lse"]) == (1, True, (-1, -1), 0.0, 0.3, False)
    assert call["cache_seqlens"].dtype == call["page_table"].dtype == torch.int32
    assert bits_equal(call["page_table"], page_table.int()) and call["k_cache"] is k_cache
    assert call["q"].shape == (2, 1, 4, 8) and out.shape == q.shape
    assert call["k"] is None and call["rotary_cos"] is None and call["cache_batch_idx"] is None


def test_npu_attention_mask_types():
    """The patched DotProductAttention on the npu backend: causal drops Megatron's mask (the
    kernel applies its own), no_mask passes, anything with an explicit mask is refused."""
    from mindspeed_tp import ConfigError
    from mindspeed_tp.numerics.canonical.strategy import mask_for_maskless_kernel as _mask_for_maskless_kernel

    assert _mask_for_maskless_kernel("causal", torch.ones(1, 1, 4, 4, dtype=torch.bool), "npu") is None
    assert _mask_for_maskless_kernel("no_mask", None, "npu") is None
    for name, mask in (("padding_causal", torch.ones(1, 1, 4, 4, dtype=torch.bool)),
                       ("no_mask", torch.ones(1, 1, 4, 4, dtype=torch.bool)), ("padding", None)):
        with pytest.raises(ConfigError, match="attn_mask_type"):
            _mask_for_maskless_kernel(name, mask, "npu")


def test_torch_decode_attention_equals_training_attention():
    """The torch backend's paged decode is the training kernel over the request's keys: bitwise."""
    from mindspeed_tp.kernels import consistent_attention, decode_attention

    torch.manual_seed(0)
    page_size, n_pages = 16, 12
    k_cache, v_cache = torch.randn(n_pages, page_size, 2, 8), torch.randn(n_pages, page_size, 2, 8)
    page_table = torch.tensor([[7, 2, 9, 0], [4, 11, 1, 3]])
    seqlens = torch.tensor([37, 64])
    q = torch.randn(2, 4, 1, 8)
    out = decode_attention(q, k_cache, v_cache, seqlens, page_table, 0.35, block_size=16)
    for i in range(2):
        n = int(seqlens[i])
        keys = k_cache[page_table[i]].reshape(-1, 2, 8)[:n].permute(1, 0, 2).unsqueeze(0)
        values = v_cache[page_table[i]].reshape(-1, 2, 8)[:n].permute(1, 0, 2).unsqueeze(0)
        full_q = torch.randn(1, 4, n, 8)
        full_q[:, :, -1:] = q[i : i + 1]
        full = consistent_attention(full_q, keys, values, 0.35, causal=True, block_size=16)
        assert bits_equal(out[i : i + 1], full[:, :, -1:])


def test_checker_on_npu_without_torch_npu_names_the_package():
    from conftest import run_cli

    proc = run_cli("check", "--device", "npu", "--seq-length", "16")
    assert proc.returncode == 2, explain(proc)
    assert "--device npu needs the package 'torch_npu'" in proc.stderr
