"""Honoured TransformerConfig fields that the bundled models and checkers leave at their defaults,
each launched at another value (issue #55: classified honoured, never run so): one checker launch per
field, bitwise across two layouts -- scoring (``check``: each layout's logprobs against one device)
or bitwise training (``train-check --bitwise-training``: every step's loss, gradients and logprobs).
``contract/config_fields.HONOURED`` cites these cases for the fields; a field that fails here moves
to refused. The full tier launches every field on every megatron-core line (the fields' meaning is the
line's code); the CI tier its two cases on the main line."""
import pytest
import yaml

from conftest import explain, main_line, on_every_line_in_the_full_tier, run_cli, test_tier as tier, tiered

GPT_OSS_GLU = {"activation_func": "quick_gelu", "activation_func_clamp_value": 1.0, "glu_linear_offset": 1.0}
# field -> (checker, bundled model, model YAML changes, --transformer-config fields, layouts[, more flags])
RUNS = {
    "qk_layernorm": ("check", "tiny-dense", {"qk_layernorm": False}, {}, "tp2-sp,tp1-pp2"),
    "normalization": ("check", "tiny-dense", {}, {"normalization": "LayerNorm"}, "tp2-sp,tp1-pp2"),
    "moe_router_pre_softmax": ("check", "tiny-moe", {"moe_router_pre_softmax": True}, {}, "tp2-sp-ep2,tp1-ep2"),
    "cp_comm_type": ("check", "tiny-dense", {}, {"cp_comm_type": "all_gather"}, "cp2,tp2-sp-cp2"),
    "recompute_method": ("train-check", "tiny-dense", {},
                         {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
                         "tp2-sp,tp1-pp2"),
    "recompute_modules": ("train-check", "tiny-dense", {},
                          {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
                          "tp2-sp,tp1-pp2"),
    "distribute_saved_activations": ("train-check", "tiny-dense", {},
                                     {"recompute_granularity": "full", "recompute_method": "uniform",
                                      "recompute_num_layers": 1, "distribute_saved_activations": True},
                                     "tp2,tp1-pp2"),
    "moe_router_bias_update_rate": ("train-check", "tiny-moe-shared", {}, {"moe_router_bias_update_rate": 0.01},
                                    "tp2-sp-ep2,tp1-ep2"),
    # attention sinks (gpt-oss): a learned logit per head in the softmax denominator, its gradient too
    # (model fields: attention_sinks and window_attn_skip_freq, so that the reference engine computes them too)
    "softmax_type": ("train-check", "tiny-dense", {"attention_sinks": True}, {}, "tp2-sp,tp1-pp2,tp1-dp2"),
    # gpt-oss' alternation: windowed odd layers, full even ones (a window of 8 keys on 128-token prompts), scored
    # against the reference engine's rollout too
    "window_attn_skip_freq": ("check", "tiny-dense", {"sliding_window": 8, "window_attn_skip_freq": 2}, {},
                              "tp2-sp,tp1-pp2", ["--rollout", "2", "--max-new-tokens", "24"]),
    # DeepSeek-V3's group-limited routing: 4 groups of 2 experts, each token choosing among its best 2
    # (one group of all, Megatron-Bridge's GLM / Kimi / Moonlight setting, is plain top-k: kernel test)
    "moe_router_num_groups": ("train-check", "tiny-glm45", {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
                              {}, "tp2-sp-ep2,tp1-ep2"),
    # gpt-oss' gated MLP (quick-GELU gate, clamped, up + 1) in the shared expert and the routed ones: trained
    # bitwise, and scored against the reference engine's rollout; a clamp of 1 bites on about a quarter of
    # this model's gate and up values (its 7 on gpt-oss' scale)
    "activation_func_clamp_value": ("train-check", "tiny-moe-shared", GPT_OSS_GLU, {}, "tp2-sp-ep2,tp1-ep2"),
    "glu_linear_offset": ("check", "tiny-moe-shared", GPT_OSS_GLU, {}, "tp2-sp-ep2,tp1-ep2", ["--rollout", "2"]),
    # gpt-oss' biases on a dense model: the output projection's and fc2's added after the fold, their gradients
    # as canonical token sums (TP+SP, PP; under CP and the MoE model's router and experts: tests/test_linear_biases.py)
    "add_bias_linear": ("train-check", "tiny-dense", {"add_qkv_bias": True, "add_bias_linear": True}, {},
                        "tp2-sp,tp1-pp2"),
}
CASES = tiered("test_honoured_fields.py: fields launched at a non-default value",
               ["normalization", "recompute_method"], sorted(RUNS),
               "a --transformer-config field through the scoring checker and one under bitwise training; a "
               "model-YAML field (qk_layernorm, pre-softmax routing) reaches the same TransformerConfig the "
               "bundled models' fields do in every parity test, and each other field is one more value through "
               "the same two paths")
if tier() == "full" and not main_line():
    CASES = sorted(RUNS)  # tiered() gives the other lines the CI cases; here every field runs on every line



def _model_file(tmp_path, name, changes):
    from mindspeed_tp.models.spec import load_model_spec

    if not changes:
        return name
    data = {k: v for k, v in load_model_spec(name).to_dict().items() if v is not None}
    data.update(changes, name=f"{name}-{'-'.join(changes)}")
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@on_every_line_in_the_full_tier
@pytest.mark.parametrize("field", CASES)
def test_an_honoured_field_at_another_value_is_bitwise_across_layouts(field, tmp_path):
    checker, model, model_changes, fields, layouts, *more = RUNS[field]
    config = tmp_path / "transformer.yaml"
    config.write_text(yaml.safe_dump(fields or {}))
    args = [checker, "--model", _model_file(tmp_path, model, model_changes), "--layouts", layouts, "--dtype", "fp32",
            "--transformer-config", str(config)]
    if checker == "train-check":
        args += ["--bitwise-training", "--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "1",
                 "--seq-length", "32"]
    args += more[0] if more else []
    proc = run_cli(*args, timeout=1200)
    from mindspeed_tp.check.user_config import config_field_names  # megatron-core's, imported at run time

    if field not in config_field_names():  # a line without the field (softmax_type before 0.15): named, exit 2
        said = "TransformerConfig has no" if model_changes else "not fields of this megatron-core"
        assert proc.returncode == 2 and said in proc.stderr and field in proc.stderr, explain(proc)
        return
    assert proc.returncode == 0, explain(proc)
    assert "bitwise" in proc.stdout.lower(), explain(proc)
