"""--transformer-config FILE.yaml: the user's TransformerConfig fields over the bundled model's, in
check, train-check and rl-check; a field the contract cannot keep exits 2 naming it before anything is
launched (the check a user's GPTModel construction runs, contract/model_config.py)."""
import pytest
import torch

from conftest import explain, run_cli

from mindspeed_tp import ConfigError
from mindspeed_tp.check import main as check_main
from mindspeed_tp.check.rl import main as rl_main
from mindspeed_tp.check.train import main as train_main


def _file(tmp_path, text):
    path = tmp_path / "f.yaml"
    path.write_text(text)
    return str(path)


def _plan(module, argv):
    return module.plan(module.resolve_args(argv))


def test_bias_activation_fusion_exits_2_naming_it_before_launching(tmp_path):
    """Issue #43's acceptance: the rollout check with the user's fused SwiGLU is refused by name."""
    path = _file(tmp_path, "bias_activation_fusion: true\n")
    proc = run_cli("check", "--model", "tiny-dense", "--tp", "2", "--sp", "--rollout", "6", "--temperature", "1.0",
                   "--transformer-config", path, timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert "bias_activation_fusion" in proc.stderr and "--no-bias-swiglu-fusion" in proc.stderr, explain(proc)


@pytest.mark.parametrize("module,argv", [
    (check_main, ["--model", "tiny-moe", "--tp", "2", "--sp", "--rollout", "6", "--temperature", "1.0"]),
    (train_main, ["--model", "tiny-moe", "--layouts", "tp2-sp-ep2"]),
    (rl_main, ["--model", "tiny-moe", "--layout", "tp2-sp-ep2"]),
], ids=["check", "train-check", "rl-check"])
def test_every_checker_refuses_the_users_router_dtype_by_name(tmp_path, module, argv):
    path = _file(tmp_path, "moe_router_dtype: fp64\n")
    with pytest.raises(ConfigError, match="moe_router_dtype='fp64'.*'fp32'"):
        _plan(module, argv + ["--transformer-config", path])
    _plan(module, argv)  # the bundled config alone is accepted


@pytest.mark.parametrize("text,needle", [
    ("no_such_field: 1\n", "not fields of this megatron-core"),
    ("activation_func: gelu\n", "functions or objects"),
    ("hidden_size: 96\n", "hidden_size=96 differs .*--model"),
    ("tensor_model_parallel_size: 4\n", "--tp"),
    ("[1, 2]\n", "a mapping"),
])
def test_a_file_the_checker_cannot_apply_is_refused_naming_the_field(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        _plan(check_main, ["--tp", "2", "--transformer-config", _file(tmp_path, text)])


def test_an_irrelevant_field_of_the_users_file_reaches_the_models_config(tmp_path):
    from mindspeed_tp.check.builder import transformer_config
    from mindspeed_tp.models.layout import Layout
    from mindspeed_tp.models.spec import load_model_spec

    fields = check_main.resolve_args(["--transformer-config", _file(
        tmp_path, "deallocate_pipeline_outputs: true\nbias_dropout_fusion: true\nhidden_size: 128\n")]).transformer_fields
    spec = load_model_spec("tiny-dense")
    assert spec.hidden_size == 128  # a field the model sets may repeat its value
    config = transformer_config(spec, Layout(tp=2), torch.bfloat16, user_fields=fields)
    assert config.deallocate_pipeline_outputs is True and config.bias_dropout_fusion is True
    assert transformer_config(spec, Layout(tp=2), torch.bfloat16).bias_dropout_fusion is False


@pytest.mark.parametrize("text,needle", [
    ("qk_layernorm: false\n", "qk_layernorm=False differs"),
    ("rotary_base: 500000\n", "rotary_base=500000 is a GPTModel argument"),
    ("q_lora_rank: 64\n", "q_lora_rank is a field of megatron-core's MLATransformerConfig"),
    ("hidden_dropout: 0.1\n", "hidden_dropout=0.1"),
    ("attention_dropout: 0.1\n", "attention_dropout"),
    ("use_kitchen_attention: true\n", "use_kitchen_attention=True"),
    ("activation_func_clamp_value: 7.0\n", "activation_func_clamp_value=7.0"),
    ("cp_comm_type: a2a\n", "cp_comm_type='a2a'"),
    ("overlap_moe_expert_parallel_comm: true\n", "overlap_moe_expert_parallel_comm=True.*combined 1F1B"),
])
def test_issue_55_settings_are_refused_naming_the_field_before_launching(tmp_path, text, needle):
    """Issue #55's acceptance: each is refused by name by the plan every checker makes before it
    launches (dropout because the checkers train the file's config; cp_comm_type at the CP layout)."""
    from mindspeed_tp.check.user_config import config_field_names

    path = _file(tmp_path, text)
    if text.split(":")[0] not in config_field_names():  # an older line: no such field to set
        needle = "not fields of this megatron-core"
    with pytest.raises(ConfigError, match=needle):
        _plan(train_main, ["--model", "tiny-dense", "--layouts", "tp2-sp,cp2", "--transformer-config", path])


def test_the_models_own_rotary_base_in_the_file_is_accepted(tmp_path):
    from mindspeed_tp.models.spec import load_model_spec

    base = load_model_spec("tiny-dense").rotary_base
    _plan(check_main, ["--tp", "2", "--transformer-config", _file(tmp_path, f"rotary_base: {base}\n")])


@pytest.mark.parametrize("text,field", [("use_kitchen_attention: true\n", "use_kitchen_attention"),
                                        ("hidden_dropout: 0.1\n", "hidden_dropout")])
def test_check_exits_2_naming_a_refused_field_set_alone(tmp_path, text, field):
    proc = run_cli("check", "--model", "tiny-dense", "--tp", "2", "--transformer-config", _file(tmp_path, text),
                   timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert field in proc.stderr, explain(proc)


def test_a_per_rank_mean_loss_is_refused_with_the_reason_not_a_model_yaml(tmp_path):
    """Issue #55: calculate_per_token_loss false was refused pointing at a model YAML, which cannot change it."""
    path = _file(tmp_path, "calculate_per_token_loss: false\n")
    with pytest.raises(ConfigError, match="calculate_per_token_loss=False.*per-token loss.*depend on the CP") as info:
        _plan(train_main, ["--model", "tiny-dense", "--layouts", "cp2", "--transformer-config", path])
    assert "--model" not in str(info.value)


def test_train_check_names_its_layouts_flag_for_a_parallel_size_in_the_file(tmp_path):
    """Issue #55: expert_model_parallel_size in the file was refused as differing from "--ep", a flag
    train-check does not have."""
    with pytest.raises(ConfigError, match="expert_model_parallel_size=4 differs.*--layouts epN"):
        _plan(train_main, ["--model", "tiny-moe", "--layouts", "tp2-sp-ep2",
                           "--transformer-config", _file(tmp_path, "expert_model_parallel_size: 4\n")])
    # the layout's own EP (not EP 1) is what the file is checked against
    _plan(train_main, ["--model", "tiny-moe", "--layouts", "tp2-sp-ep2",
                       "--transformer-config", _file(tmp_path, "expert_model_parallel_size: 2\n")])
