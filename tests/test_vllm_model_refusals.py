"""What the vllm-cpu profiles do not model, refused by name before the engine or any worker starts
(it would start, then die in a kernel or score with a silent mismatch). Needs vLLM installed (the
refusals ask it which head sizes its CPU attention has): collected in .venv-vllm only, and not on an
AMX host, where every vllm-cpu profile is refused first (tests/test_vllm_profile.py)."""
import pytest

from mindspeed_tp.errors import ConfigError

from conftest import explain, run_cli


@pytest.mark.parametrize("config,refused", [({"head_dim": 16}, True), ({"head_dim": None}, True),
                                             ({"head_dim": 32}, False)])
def test_a_head_size_the_engines_cpu_attention_lacks_is_refused_before_it_starts(tmp_path, monkeypatch, config,
                                                                                 refused):
    """vllm-cpu 0.32 accepts a model with head size 16 and dies in its attention kernel on the first
    batch: start_engine refuses it naming the size (head_dim, or hidden / heads as vLLM reads it)
    before vllm.LLM; a supported size gets past the check (to vllm.LLM, stubbed here)."""
    import json

    from mindspeed_tp.integrations.vllm import engine

    (tmp_path / "config.json").write_text(json.dumps(dict(hidden_size=64, num_attention_heads=4, **config)))

    class Started(Exception):
        pass

    monkeypatch.setattr(engine, "check_engine_settings", lambda *a: (_ for _ in ()).throw(Started()))
    with pytest.raises(ConfigError if refused else Started) as err:
        engine.start_engine(str(tmp_path), 1, "bfloat16", 64, 64)
    assert not refused or "head_dim=16" in str(err.value), err.value


@pytest.mark.parametrize("model,named,dtype", [
    ("tiny-moe-shared", "a sigmoid router is GLM-4.5's or DeepSeek-V3's MoE block in the engine: family glm4_moe "
     "or deepseek_v3", "fp32"),
    # Moonlight's shape: no query latent, a 56-wide kv latent (vLLM's CPU MLA decodes 512 + 64 only), plain RoPE
    ("tiny-mla", "multi_latent_attention with profile='vllm-cpu-tp1' is not supported", "bf16"),
    ("tiny-deepseek-v3-mla576", "multi-latent attention in fp32", "fp32"),
    ("tiny-glm45", "partial RoPE (rotary_percent=0.5) in fp32", "fp32"),
    # gpt-oss' GLU on a Qwen3 model: named from the model spec before the checkpoint is exported (a model
    # built in the user's own process meets the profile's check_swiglu: tests/test_gated_mlp.py)
    ("tiny-dense:gpt-oss-glu", "the gated MLP (activation, clamp, offset)=('quick_gelu', 7.0, 1.0)", "bf16"),
    # biases on every linear layer (gpt-oss'), and the whole gpt-oss family (its GLU named first)
    ("tiny-moe-bias", "biases on every linear layer (add_bias_linear)", "bf16"),
    ("tiny-gpt-oss", "the gated MLP (activation, clamp, offset)=('quick_gelu', 1.0, 1.0)", "bf16"),
])
def test_a_model_the_engine_profiles_do_not_model_exits_2_before_an_engine_starts(model, named, dtype, tmp_path):
    """DeepSeek-style routing (sigmoid, expert bias, shared expert) on a family whose checkpoint the
    engine runs as another architecture (Qwen3-MoE: no shared experts, softmax), multi-latent
    attention beyond what vLLM's CPU MLA is modelled for (numerics/vllm/mla.py) and a partial-RoPE model in fp32 (GLM-4.5 matches
    in bf16 only), gpt-oss' clamped quick-GEGLU (vLLM computes it with its own kernel) and its biases are not what
    the vllm-cpu profiles model: refused by name before a worker or the engine starts."""
    if model.endswith(":gpt-oss-glu"):
        import yaml

        from mindspeed_tp.models.spec import load_model_spec

        data = {k: v for k, v in load_model_spec(model.split(":")[0]).to_dict().items() if v is not None}
        data.update(name="tiny-dense-gpt-oss-glu", activation_func="quick_gelu", activation_func_clamp_value=7.0,
                    glu_linear_offset=1.0)
        model = str(tmp_path / "model.yaml")
        (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    proc = run_cli("check", "--engine", "vllm", "--profile", "vllm-cpu-tp1", "--model", model, "--rollout", "2",
                   "--dtype", dtype, timeout=300)
    assert proc.returncode == 2 and named in proc.stderr, explain(proc)
    assert "vLLM" not in proc.stdout and "Worker" not in proc.stderr, explain(proc)
