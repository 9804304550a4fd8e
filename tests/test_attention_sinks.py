"""Attention sinks (megatron-core's softmax_type 'learnable' / 'off-by-one', gpt-oss' ``sinks``): a
logit per head in every query's softmax denominator, with no value. The consistent attention joins it
to the online-softmax state once, after the last key block (kernels/backends/torch.py), so a head's
bits do not depend on which heads run beside it (TP), on the query rows computed together, or on
training vs a decode step; its gradient is each head's (batch, query) terms summed in one order. The
Triton and Ascend kernels refuse sinks by name."""
import pytest
import torch

from mindspeed_tp.contract.refusals import ConfigError
from mindspeed_tp.kernels.attention import consistent_attention, decode_attention
from mindspeed_tp.kernels.backends import torch as torch_backend

from conftest import bits_equal


def _qkv(b=2, hq=8, hkv=4, sq=300, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(b, h, sq, d, generator=g).to(dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), (torch.randn(hq, generator=g) * 2).to(dtype)


def _hf_eager(q, k, v, sinks, scale, window=None):
    """transformers' gpt-oss eager attention: softmax over [scores, sink], max subtracted, sink dropped."""
    b, hq, sq, d = q.shape
    g = hq // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    scores = q.float() @ kf.transpose(-1, -2) * scale
    pos = torch.arange(sq)
    hidden = pos[None, :] > pos[:, None]
    if window is not None:
        hidden |= pos[None, :] < pos[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    full = torch.cat([scores, sinks.float().reshape(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    full = full - full.max(dim=-1, keepdim=True).values
    return (torch.softmax(full, dim=-1)[..., :-1] @ vf).to(q.dtype)


@pytest.mark.parametrize("window", [None, 40])
def test_sinks_give_transformers_eager_attention(window):
    q, k, v, sinks = _qkv()
    out = consistent_attention(q, k, v, 32 ** -0.5, window=window, sinks=sinks)
    ref = _hf_eager(q, k, v, sinks, 32 ** -0.5, window)
    # the semantics against transformers' formula (one softmax over all keys: another summation order,
    # so fp32 rounding apart); the bitwise claims are the layout tests below, on integer views

    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)
    plain = consistent_attention(q, k, v, 32 ** -0.5, window=window)
    assert (out - plain).abs().max() > 1e-3  # the sinks take probability mass
    off_by_one = consistent_attention(q, k, v, 32 ** -0.5, window=window, sinks=torch.zeros(8))
    assert torch.allclose(off_by_one, _hf_eager(q, k, v, torch.zeros(8), 32 ** -0.5, window), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_heads_bits_do_not_depend_on_the_heads_beside_it_or_on_decoding(dtype):
    q, k, v, sinks = _qkv(dtype=dtype)
    full = consistent_attention(q, k, v, 32 ** -0.5, sinks=sinks)
    for tp in (2, 4):  # a TP rank's heads: its query heads, their KV heads, their sinks
        hq, hkv = 8 // tp, 4 // tp
        for r in range(tp):
            part = consistent_attention(q[:, r * hq:(r + 1) * hq], k[:, r * hkv:(r + 1) * hkv],
                                        v[:, r * hkv:(r + 1) * hkv], 32 ** -0.5, sinks=sinks[r * hq:(r + 1) * hq])
            assert bits_equal(part, full[:, r * hq:(r + 1) * hq]), (tp, r)
    # the last 3 positions as a decode step over a paged cache (pages of 16)
    b, n = q.shape[0], q.shape[2]
    pages = -(-n // 16)
    cache = lambda t: torch.nn.functional.pad(t.permute(0, 2, 1, 3), (0, 0, 0, 0, 0, pages * 16 - n)).reshape(  # noqa: E731
        b * pages, 16, *t.shape[1:2], t.shape[-1])
    table = torch.arange(b * pages).reshape(b, pages)
    step = decode_attention(q[:, :, -3:], cache(k), cache(v), torch.full((b,), n), table, 32 ** -0.5, sinks=sinks)
    assert bits_equal(step, full[:, :, -3:])


def test_a_query_that_sees_no_key_gives_zero_and_the_sink_its_whole_weight():
    q, k, v, sinks = _qkv(sq=20)
    hidden = torch.zeros(1, 1, 20, 20, dtype=torch.bool)
    hidden[..., 5, :] = True  # query 5 sees nothing
    out = consistent_attention(q, k, v, 32 ** -0.5, excluded=hidden, sinks=sinks)
    assert bits_equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    assert torch.isfinite(out).all()


def test_the_sinks_gradient_is_transformers_and_the_same_bits_in_any_head_split():
    q, k, v, sinks = _qkv(sq=300)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = consistent_attention(*leaves[:3], 32 ** -0.5, sinks=leaves[3])
    grad = torch.randn_like(out)
    out.backward(grad)
    ref = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    _hf_eager(*ref, 32 ** -0.5).backward(grad)
    for got, want in zip(leaves, ref):  # semantics (another summation order); bits across head splits below
        assert torch.allclose(got.grad, want.grad, atol=1e-4, rtol=1e-4)
    for r in range(2):
        part = [t.clone().requires_grad_() for t in (q[:, 4 * r:4 * r + 4], k[:, 2 * r:2 * r + 2],
                                                     v[:, 2 * r:2 * r + 2], sinks[4 * r:4 * r + 4])]
        consistent_attention(*part[:3], 32 ** -0.5, sinks=part[3]).backward(grad[:, 4 * r:4 * r + 4])
        assert bits_equal(part[3].grad, leaves[3].grad[4 * r:4 * r + 4])


def test_the_kernels_without_a_sink_term_refuse_it_by_name():
    from mindspeed_tp.kernels.backends import triton as triton_backend

    q, k, v, sinks = _qkv(sq=8)
    with pytest.raises(ConfigError, match="attention sinks .* torch backend only"):
        triton_backend.attention(q, k, v, 1.0, sinks=sinks)
    assert torch_backend.attention(q, k, v, 1.0, sinks=sinks).shape == q.shape


def test_sinks_under_context_parallelism_exit_2_naming_the_setting(tmp_path):
    from conftest import explain, run_cli

    import yaml

    from mindspeed_tp.models.spec import load_model_spec

    model = tmp_path / "sinks.yaml"  # the model field (megatron's softmax_type 'learnable')
    data = {k: v for k, v in load_model_spec("tiny-dense").to_dict().items() if v is not None}
    model.write_text(yaml.safe_dump(dict(data, name="tiny-dense-sinks", attention_sinks=True)))
    proc = run_cli("check", "--model", str(model), "--layouts", "tp1-cp2", "--seq-length", "64")
    assert proc.returncode == 2, explain(proc)
    assert "attention sinks (softmax_type='learnable')" in proc.stderr and "context_parallel_size=1" in proc.stderr, \
        explain(proc)


def test_alternating_windows_follow_megatrons_rule_per_layer():
    """gpt-oss' layers alternate a sliding window and full attention (``window_attn_skip_freq``): the
    window a layer's attention gets is megatron-core's choice for its global layer number."""
    from types import SimpleNamespace

    from mindspeed_tp.numerics.base import attention_window

    def windows(skip):
        config = SimpleNamespace(window_size=(7, 0), window_attn_skip_freq=skip)
        return [attention_window(SimpleNamespace(config=config, layer_number=n)) for n in range(1, 5)]

    assert windows(None) == [7, 7, 7, 7]
    assert windows(2) == [7, None, 7, None]  # every 2nd layer full (gpt-oss: sliding first)
    assert windows([1, 0, 0, 1]) == [7, None, None, 7]
    assert attention_window(SimpleNamespace(config=SimpleNamespace(window_size=None, window_attn_skip_freq=2),
                                            layer_number=1)) is None
