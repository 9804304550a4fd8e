"""Every field of the installed megatron-core's TransformerConfig (and MLATransformerConfig) is
classified once (mindspeed_tp/contract/config_fields.py): honoured with the test that shows it, refused
with its refusal key, or irrelevant with a reason. A field a newer line adds fails here until it is
classified. The refused settings of a user's config are refused by name by the one check every
GPTModel construction and the checkers run (contract/model_config.py)."""
import copy
import dataclasses
import os

import pytest
import torch.nn.functional as F

from conftest import ROOT

from mindspeed_tp import ConfigError
from mindspeed_tp.contract import config_fields, refusals
from mindspeed_tp.contract.model_config import check_model_config

pytestmark = pytest.mark.version_lines  # run on every megatron-core line (scripts/test.sh)


def _installed_fields():
    from megatron.core.transformer import transformer_config as tc

    names = [f.name for f in dataclasses.fields(tc.TransformerConfig)]
    mla = getattr(tc, "MLATransformerConfig", None)
    if mla is not None:
        names += [f.name for f in dataclasses.fields(mla) if f.name not in names]
    return names


def test_every_transformer_config_field_is_classified_once():
    fields = _installed_fields()
    tables = (config_fields.HONOURED, config_fields.REFUSED, config_fields.IRRELEVANT)
    unclassified = [f for f in fields if config_fields.classify(f) is None]
    assert unclassified == [], f"classify these fields in mindspeed_tp/contract/config_fields.py: {unclassified}"
    twice = [f for f in fields if sum(f in t for t in tables) > 1]
    assert twice == []
    unknown_keys = {f: k for f, k in config_fields.REFUSED.items() if k not in refusals.REFUSALS}
    assert unknown_keys == {}
    for field, test in config_fields.HONOURED.items():
        path, name = test.split("::")
        with open(os.path.join(ROOT, path)) as f:
            assert f"def {name}(" in f.read(), (field, test)
    assert all(reason.strip() for reason in config_fields.IRRELEVANT.values())


def _accepted_config():
    """A Qwen3-style TransformerConfig the contract keeps (what the checker's builder makes)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                             normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
                             activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
                             use_cpu_initialization=True)


# (field, value) -> the refusal names the field. Items 1-3 of issue #43 first.
REFUSED_VALUES = [
    ("bias_activation_fusion", True), ("activation_func_clamp_value", 7.0), ("glu_linear_offset", 1.0),
    ("fused_single_qkv_rope", True), ("softmax_scale", 0.5), ("rotary_interleaved", True),
    ("fp32_residual_connection", True), ("add_bias_linear", True), ("add_qkv_bias", True), ("fp16", True),
    ("fp8", "hybrid"), ("qk_l2_norm", True), ("attention_output_gate", True), ("mtp_num_layers", 1),
    ("activation_func", F.gelu), ("gradient_accumulation_fusion", True), ("window_size", (4, 0)),
]


@pytest.mark.parametrize("field,value", REFUSED_VALUES, ids=[f for f, _ in REFUSED_VALUES])
def test_a_refused_setting_is_refused_naming_it(field, value):
    config = _accepted_config()
    check_model_config(config)
    if not hasattr(config, field):
        return  # an older line without the field cannot be given it
    bad = copy.copy(config)
    setattr(bad, field, value)
    with pytest.raises(ConfigError, match=field):
        check_model_config(bad)


@pytest.mark.parametrize("value", ["fp64", None, "fp16"])
def test_an_moe_router_dtype_other_than_fp32_is_refused(value):
    config = copy.copy(_accepted_config())
    config.num_moe_experts, config.moe_router_dtype = 4, "fp32"
    check_model_config(config)
    config.moe_router_dtype = value
    with pytest.raises(ConfigError, match="moe_router_dtype"):
        check_model_config(config)


def test_bias_dropout_fusion_is_refused_with_an_engine_profile_only():
    from mindspeed_tp.contract.profile import load_profile

    config = copy.copy(_accepted_config())
    config.bias_dropout_fusion = True
    check_model_config(config, load_profile("default"))
    with pytest.raises(ConfigError, match="bias_dropout_fusion"):
        check_model_config(config, load_profile("vllm-cpu-tp1"))
