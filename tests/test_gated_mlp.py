"""The gated MLP megatron's unfused glu computes (MLP.glu, the experts' glu): SwiGLU and gpt-oss'
clamped quick-GEGLU (activation_func=quick_gelu, activation_func_clamp_value=7,
glu_linear_offset=1), by ``kernels/elementwise.glu`` in every strategy and the reference engine.

Semantics: the op-by-op formula of megatron's glu and of transformers' GptOssExperts (each op
rounded in the model dtype), compared bit for bit on contiguous whole runs (where ATen's own
sigmoid and silu run their vector code on every element: tests/test_elementwise_invariance.py);
megatron's own quick_gelu is torch.compile'd (jit_fuser), which may keep the fp32 intermediates
unrounded, so its bf16 bits are not the reference. The clamp bites forward (the value at the clamp)
and backward (no gradient through a clamped element). Invariance across shard widths, rows and
threads: tests/test_elementwise_invariance.py (gpt_oss_glu, gpt_oss_glu_backward); across layouts
and under bitwise training: tests/test_honoured_fields.py (activation_func_clamp_value,
glu_linear_offset)."""
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import bits_equal, host_cpu
from mindspeed_tp.kernels import elementwise

CASES = {  # (activation, clamp, offset)
    "swiglu": ("silu", None, 0.0),
    "gpt-oss": ("quick_gelu", 7.0, 1.0),
    "clamped-offset-swiglu": ("silu", 0.5, 0.25),
}


def _formula(gate, up, activation, clamp, offset):
    """megatron's glu / transformers' GptOssExperts, op by op with ATen's ops."""
    if clamp is not None:
        gate, up = gate.clamp(min=None, max=clamp), up.clamp(min=-clamp, max=clamp)
    act = F.silu(gate) if activation == "silu" else gate * torch.sigmoid(gate * 1.702)
    return act * (up + offset) if offset else act * up


def _operands(dtype, seed=0):
    """Contiguous whole runs (8 rows of 512: ATen's vector loop covers every element), values on
    both sides of the clamps."""
    g = torch.Generator().manual_seed(seed)
    return (6 * torch.randn(8, 512, generator=g)).to(dtype), (6 * torch.randn(8, 512, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gated_mlp_is_megatrons_glu_op_by_op(case, dtype):
    gate, up = _operands(dtype)
    got = elementwise.glu(gate, up, *CASES[case])
    assert bits_equal(got, _formula(gate, up, *CASES[case])), f"{case} {dtype} on {host_cpu()}"
    fused = elementwise.gated_linear_unit(torch.cat([gate, up], dim=-1), *CASES[case])
    assert bits_equal(fused, got)


def test_gpt_oss_clamp_bites_forward_and_backward():
    gate, up = _operands(torch.float32, seed=1)
    gate.requires_grad_(True)
    up.requires_grad_(True)
    out = elementwise.glu(gate, up, "quick_gelu", 7.0, 1.0)
    over, outside = gate.detach() > 7.0, up.detach().abs() > 7.0
    assert over.any() and outside.any() and not over.all()
    unclamped = elementwise.glu(gate.detach(), up.detach(), "quick_gelu", None, 1.0)
    assert not bits_equal(out.detach()[over | outside], unclamped[over | outside])
    at_clamp = elementwise.glu(torch.full_like(gate, 7.0), up.detach().clamp(-7.0, 7.0), "quick_gelu", None, 1.0)
    assert bits_equal(out.detach()[over], at_clamp[over])
    grad_gate, grad_up = torch.autograd.grad(out, (gate, up), torch.ones_like(out))
    assert (grad_gate[over] == 0).all() and (grad_gate[~over] != 0).any()
    assert (grad_up[outside] == 0).all() and (grad_up[~outside] != 0).all()


def test_the_reference_engine_computes_the_models_gated_mlp():
    """The spec's fields reach the reference engine's MLP (dense and experts: one _mlp)."""
    import dataclasses

    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.models.spec import load_model_spec
    from mindspeed_tp.reference.model import ReferenceModel

    spec = dataclasses.replace(load_model_spec("tiny-moe-shared"), activation_func="quick_gelu",
                               activation_func_clamp_value=1.0, glu_linear_offset=1.0)
    model = ReferenceModel.seeded(spec, load_profile(None), 0, torch.float32)
    gate, up = _operands(torch.float32)
    assert bits_equal(model.activation(torch.cat([gate, up], dim=-1)), _formula(gate, up, "quick_gelu", 1.0, 1.0))


@pytest.mark.parametrize("fields,needle", [
    ({"activation_func": "gelu"}, "activation_func='gelu' is not one of"),
    ({"activation_func_clamp_value": 0.0}, "activation_func_clamp_value must be a positive number"),
])
def test_a_gated_mlp_the_patches_do_not_compute_is_refused_by_name(fields, needle):
    import dataclasses

    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.models.spec import load_model_spec

    with pytest.raises(ConfigError, match=needle):
        dataclasses.replace(load_model_spec("tiny-dense"), **fields)


@pytest.mark.parametrize("glu", [("quick_gelu", 7.0, 1.0), ("silu", 7.0, 0.0), ("silu", None, 1.0)])
def test_the_vllm_profiles_refuse_any_gated_mlp_but_swiglu_by_name(glu):
    """vLLM's MLPs are SiLU-and-mul (gpt-oss' clamped GLU is its own swigluoai kernel, not modelled):
    the profile's model construction refuses the rest naming them; SwiGLU passes."""
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.vllm.refusals import check_swiglu

    check_swiglu(("silu", None, 0.0))
    with pytest.raises(ConfigError, match=re.escape(f"(activation, clamp, offset)={glu}")):
        check_swiglu(glu)


def test_the_model_fields_activations_are_the_ones_the_kernels_compute():
    from mindspeed_tp.models.spec import GATED_ACTIVATIONS

    assert set(GATED_ACTIVATIONS) == set(elementwise.ACTIVATIONS)
