"""GPTModel construction under the patches refuses what no patch covers, naming the setting."""
import textwrap

import pytest

from conftest import explain, run_python

pytestmark = pytest.mark.version_lines  # also run on megatron-core 0.12.x (scripts/test.sh)

CODE = """
import torch, torch.nn.functional as F, torch.distributed as dist
import mindspeed_tp
from mindspeed_tp.check.driver import init_distributed
init_distributed()
mindspeed_tp.enable()
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                        normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                        gated_linear_unit=True, activation_func=F.silu, moe_router_dtype="fp32",
                        perform_initialization=False, {extra})
try:
    GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts={experts}, normalization="RMSNorm"),
             vocab_size=1024, max_sequence_length=64, position_embedding_type="rope"{gpt})
    print("BUILT")
except mindspeed_tp.ConfigError as exc:
    print("REFUSED", exc)
"""


def _run(extra="", experts="None", gpt=""):
    proc = run_python(CODE.format(extra=extra, experts=experts, gpt=gpt))
    assert proc.returncode == 0, explain(proc)
    return proc.stdout


def test_dense_local_spec_builds():
    assert "BUILT" in _run()


def test_moe_model_builds():
    assert "BUILT" in _run(extra="num_moe_experts=4, moe_router_topk=2", experts="4")


@pytest.mark.parametrize("gpt,name", [(", seq_len_interpolation_factor=2.0", "seq_len_interpolation_factor")])
def test_a_gpt_model_argument_the_engines_do_not_model_is_refused_at_construction(gpt, name):
    """Issue #55: unchecked under the default and rollout-tp profiles before; refused by name now
    (rotary_percent, refused then, is honoured since GLM-4.5: tests/test_families_moe.py)."""
    out = _run(gpt=gpt)
    assert "REFUSED" in out and f"GPTModel({name}=" in out, out


def test_moe_capacity_factor_is_refused():
    out = _run(extra="num_moe_experts=4, moe_router_topk=2, moe_expert_capacity_factor=1.0", experts="4")
    assert "REFUSED" in out and "moe_expert_capacity_factor" in out


def test_moe_grouped_gemm_is_refused():
    out = _run(extra="num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True", experts="4")
    assert "REFUSED" in out and "moe_grouped_gemm" in out


def test_fused_cross_entropy_is_refused():
    out = _run(extra="cross_entropy_loss_fusion=True")
    assert "REFUSED" in out and "cross_entropy_loss_fusion" in out


def test_training_settings_outside_the_patched_gemms_are_refused_by_name():
    for extra, name in (("gradient_accumulation_fusion=True", "gradient_accumulation_fusion"),
                        ("enable_cuda_graph=True", "enable_cuda_graph")):
        out = _run(extra=extra)
        assert "REFUSED" in out and name in out, (extra, out)


MLP_CODE = CODE.replace("ffn_hidden_size=128", "ffn_hidden_size=200") + """
from mindspeed_tp.check.metrics import same_bits
from mindspeed_tp.kernels.elementwise import gated_linear_unit
from mindspeed_tp.patches.mlp import mlp_forward
model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=None, normalization="RMSNorm"),
                 vocab_size=1024, max_sequence_length=64, position_embedding_type="rope")
mlp = model.decoder.layers[0].mlp
for p in mlp.parameters():
    torch.nn.init.normal_(p, std=0.2)
x = 3 * torch.randn(7, 1, 64)
out, bias = mlp(x)
fc1, _ = mlp.linear_fc1(x)
expected, _ = mlp.linear_fc2(gated_linear_unit(fc1))  # SwiGLU: silu, no clamp, no offset
print("MLP", fc1.shape[-1], bias is None, same_bits(out, expected))
def newer_forward(self, hidden_states, per_token_scale=None, padding_mask=None, **kwargs):
    raise AssertionError("not reached")
try:
    mlp_forward(newer_forward)(mlp, x, padding_mask=torch.ones(7, dtype=torch.bool))
except mindspeed_tp.ConfigError as exc:
    print("REFUSED", exc)
print("UNSET", same_bits(mlp_forward(newer_forward)(mlp, x, padding_mask=None)[0], out))
"""


def test_megatrons_mlp_computes_the_position_invariant_swiglu():
    """MLP.forward under the patches (every version line): fc1, kernels/elementwise.gated_linear_unit (SwiGLU), fc2, here on
    a 200-column FFN (a width ATen's silu computes partly in its scalar tail); an argument a newer
    megatron-core names in MLP.forward's signature is refused by name unless left unset."""
    proc = run_python(MLP_CODE.format(extra="bf16=False", experts="None", gpt=""))
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout
    assert "MLP 400 True True" in out, out
    assert "REFUSED" in out and "padding_mask" in out and "UNSET True" in out, out


FUSED_NORM_CODE = """
import torch.nn.functional as F
import mindspeed_tp
from mindspeed_tp.check.driver import init_distributed
init_distributed()
mindspeed_tp.enable()
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
import megatron.core.fusions.fused_layer_norm as fused
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
# Stand-in for an installed apex: FusedLayerNorm then builds its parameters (its forward, which would
# call apex's kernel, never runs). With apex importable, megatron's local spec picks this class.
fused.HAVE_FUSED_LAYER_NORM = True
spec = get_gpt_layer_local_spec(normalization="LayerNorm")
spec.submodules.input_layernorm = fused.FusedLayerNorm
spec.submodules.pre_mlp_layernorm = fused.FusedLayerNorm
cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                        normalization="LayerNorm", add_bias_linear=False, use_cpu_initialization=True,
                        gated_linear_unit=True, activation_func=F.silu, perform_initialization=False)
try:
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=1024, max_sequence_length=64,
                     position_embedding_type="rope")
    print("BUILT", type(model.decoder.layers[0].input_layernorm).__name__)
except mindspeed_tp.ConfigError as exc:
    print("REFUSED", exc)
"""


def test_megatron_fused_layer_norm_is_refused_by_name():
    """megatron.core.fusions.fused_layer_norm.FusedLayerNorm (apex inside, megatron's module name)."""
    proc = run_python(FUSED_NORM_CODE)
    assert proc.returncode == 0, explain(proc)
    assert "REFUSED" in proc.stdout, proc.stdout
    assert "FusedLayerNorm" in proc.stdout and "WrappedTorchNorm" in proc.stdout, proc.stdout


def test_torch_compile_of_megatron_modules_is_refused_while_enabled():
    """dynamo would break the graph at a refusal inside the patched code and run it eagerly, so
    torch.compile itself refuses (only while enabled; other modules compile as before)."""
    code = textwrap.dedent("""
        import torch
        import mindspeed_tp
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Linear(4, 4)
        Block.__module__ = "megatron.core.transformer.block_like"
        mindspeed_tp.enable()
        for target in (Block(), Block().forward, torch.nn.Sequential(Block())):
            try:
                torch.compile(target)
                print("COMPILED", type(target).__name__)
            except mindspeed_tp.ConfigError as exc:
                print("REFUSED", "torch.compile(" in str(exc))
        print("PLAIN", type(torch.compile(torch.nn.Linear(4, 4))).__name__)
        mindspeed_tp.disable()
        print("AFTER_DISABLE", type(torch.compile(Block())).__name__)
    """)
    proc = run_python(code)
    assert proc.returncode == 0, explain(proc)
    lines = [l for l in proc.stdout.splitlines() if l.split(" ")[0] in ("REFUSED", "COMPILED", "PLAIN", "AFTER_DISABLE")]
    assert lines == ["REFUSED True"] * 3 + ["PLAIN OptimizedModule", "AFTER_DISABLE OptimizedModule"]


@pytest.mark.parametrize("name", ["inference_context", "inference_params"])
def test_megatrons_own_inference_context_is_refused_at_the_forward(name):
    """Issue #43, item 1: megatron's inference path (its RoPE for dynamic batches, attention.py's
    inference_context branch, its KV cache) bypasses the patched kernels."""
    from mindspeed_tp import ConfigError
    from mindspeed_tp.patches.models import gpt_model_forward

    forward = gpt_model_forward(lambda self, *a, **k: "RAN")
    with pytest.raises(ConfigError, match=f"GPTModel.forward with {name}"):
        forward(object(), None, None, None, **{name: object()})
    assert forward(object(), None, None, None, **{name: None}) == "RAN"
