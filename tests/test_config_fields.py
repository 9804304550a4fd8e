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
        name, _, case = name.partition("[")
        with open(os.path.join(ROOT, path)) as f:
            source = f.read()
        assert f"def {name}(" in source, (field, test)
        if case and path.endswith("test_honoured_fields.py"):  # the field launched at another value
            from test_honoured_fields import RUNS

            assert case.rstrip("]") == field and field in RUNS, (field, test)
        elif case:  # another parametrized test: the case's id is in its file
            assert f'"{case.rstrip("]")}"' in source, (field, test)
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
    ("bias_activation_fusion", True), ("fused_single_qkv_rope", True), ("softmax_scale", 0.5), ("rotary_interleaved", True),
    ("fp32_residual_connection", True), ("fp16", True),
    ("fp8", "hybrid"), ("qk_l2_norm", True), ("attention_output_gate", True), ("mtp_num_layers", 1),
    ("activation_func", F.gelu), ("gradient_accumulation_fusion", True), ("window_size", (4, 2)),
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


def _field_types():
    from megatron.core.transformer import transformer_config as tc

    out = {}
    for cls in (tc.TransformerConfig, getattr(tc, "MLATransformerConfig", None)):
        for f in dataclasses.fields(cls) if cls is not None else ():
            out.setdefault(f.name, f.type)
    return out


def _other_value(field, kind):
    """A value of ``field``'s type other than its default on this line (and than what ACCEPTED allows)."""
    import typing

    default = config_fields.line_defaults()[field][0]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    literals = [a for a in (typing.get_args(args[0]) if args and typing.get_origin(args[0]) is typing.Literal
                            else typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else ())]
    candidates = [v for v in literals if v != default and v != "fp32"]
    if isinstance(default, bool) or bool in (kind, *args):
        candidates.append(not default if isinstance(default, bool) else True)
    elif isinstance(default, (int, float)) and not isinstance(default, bool):
        candidates.append(default + 3)
    elif default is None:
        candidates += [v for t, v in ((int, 3), (float, 0.75), (str, "other")) if t in args]
    candidates += ["other", 3]
    return next(v for v in candidates if config_fields.refused_value(field, v))


def test_every_refused_field_alone_at_another_value_is_refused_naming_it():
    """Generated from config_fields.REFUSED on the installed line: no refused field is paperwork --
    each, set alone on an accepted config, raises a ConfigError that names it (its specific refusal,
    or the refusal every refused field gets at a value other than its default)."""
    types = _field_types()
    base = _accepted_config()
    check_model_config(base)
    accepted, walked = [], 0
    for field in config_fields.REFUSED:
        if field not in types:
            continue  # not a field of this line
        if field in config_fields.ACCEPTED and config_fields.ACCEPTED[field][0](object()):
            continue  # refused only in a context (training, an engine profile): tests below
        value = _other_value(field, types[field])
        walked += 1
        bad = copy.copy(base)
        setattr(bad, field, value)
        try:
            check_model_config(bad)
            accepted.append((field, value))
        except ConfigError as exc:
            assert field in str(exc), (field, value, str(exc))
    assert accepted == []
    context_only = [f for f in config_fields.ACCEPTED if f in types and config_fields.ACCEPTED[f][0](object())]
    assert walked == len(types.keys() & config_fields.REFUSED.keys()) - len(context_only) > 50


def test_the_context_refusals_refuse_in_their_context():
    from mindspeed_tp.contract.profile import load_profile

    config = copy.copy(_accepted_config())
    config.hidden_dropout = 0.1  # megatron's default: a scoring model may carry it
    check_model_config(config)
    with pytest.raises(ConfigError, match="hidden_dropout=0.1"):
        check_model_config(config, training=True)
    config = copy.copy(_accepted_config())
    config.attention_dropout = 0.1
    with pytest.raises(ConfigError, match="attention_dropout"):
        check_model_config(config, load_profile("default"), training=True)
    config = copy.copy(_accepted_config())
    config.context_parallel_size, config.cp_comm_type = 2, "a2a"
    with pytest.raises(ConfigError, match="cp_comm_type='a2a'"):
        check_model_config(config)
    config.cp_comm_type = ["p2p", "all_gather"]
    check_model_config(config)
    config.context_parallel_size, config.cp_comm_type = 1, "a2a"  # unread without CP
    check_model_config(config)


def test_every_field_a_specific_check_reads_is_classified_refused_under_its_key():
    """The refused settings live in one table: what model_config's grouped checks and the refusal
    entries that read a config attribute name is config_fields.REFUSED's, under the same key."""
    from mindspeed_tp.contract import model_config

    fields = _field_types()
    for name in ("fp8", "fp4", "use_kitchen", "quant_recipe"):
        assert config_fields.REFUSED.get(name) == "low_precision", name
    for name, *_ in model_config._VARIANTS:
        assert config_fields.classify(name) in (("refused", "architecture_variant"),
                                                ("honoured", config_fields.HONOURED.get(name))), name
    for r in refusals.REFUSALS.values():
        if r.attr and r.where in (refusals.MODEL, refusals.ATTENTION, refusals.NORM, refusals.MOE, refusals.ENGINE) \
                and r.attr in fields:
            # refused, or honoured with some values refused (moe_router_load_balancing_type: sinkhorn)
            assert config_fields.classify(r.attr) is not None, r.attr


def _gpt_model_parameters():
    import inspect

    from megatron.core.models.gpt.gpt_model import GPTModel

    return {n: p for n, p in list(inspect.signature(GPTModel.__init__).parameters.items())[1:]}


def test_every_gpt_model_argument_is_classified_and_refused_by_name():
    """Walks the installed GPTModel.__init__: each argument classified (contract/model_arguments.py),
    the line's defaults accepted as mbridge passes them, every refused argument at a value it does
    not accept refused naming it, and an argument no table knows refused rather than swallowed."""
    import inspect

    from mindspeed_tp.contract import model_arguments as ma

    params = _gpt_model_parameters()
    assert [n for n in params if ma.classify(n) is None] == []
    for name, test in ma.HONOURED.items():
        path, fn = test.split("::")
        fn, _, case = fn.partition("[")
        with open(os.path.join(ROOT, path)) as f:
            source = f.read()
        assert f"def {fn}(" in source and (not case or f'"{case.rstrip("]")}"' in source), (name, test)
    base = {n: (p.default if p.default is not inspect.Parameter.empty else object()) for n, p in params.items()}
    base.update(position_embedding_type="rope", rotary_base=1000000, share_embeddings_and_output_weights=True)
    ma.check_gpt_model_arguments(base)
    others = {"fp16_lm_cross_entropy": True, "parallel_output": False, "position_embedding_type": "learned_absolute",
              "seq_len_interpolation_factor": 2.0,
              "mtp_block_spec": object(), "scatter_embedding_sequence_parallel": False}
    assert set(others) == set(ma.REFUSED)
    for name, value in others.items():
        if name not in params:
            continue  # not an argument of this line
        with pytest.raises(ConfigError, match=rf"GPTModel\({name}="):
            ma.check_gpt_model_arguments({**base, name: value})
    with pytest.raises(ConfigError, match="new_argument"):
        ma.check_gpt_model_arguments({**base, "new_argument": 1})


def test_a_process_group_collection_of_other_groups_is_refused():
    from conftest import explain, run_torchrun

    proc = run_torchrun("process_groups.py", 2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "ACCEPTED [1, 1] REFUSED BY NAME [1, 1]" in proc.stdout, explain(proc)


def test_a_norm_the_patched_norm_does_not_compute_is_refused_at_the_config_and_at_construction():
    """The norm-construction refusals (issue #55: tested nowhere before): a normalization other than
    RMSNorm / LayerNorm at the config check (the checkers refuse it before launching) and at the
    norm's construction; layernorm_zero_centered_gamma at the config check."""
    from mindspeed_tp.patches.norms import ConsistentNorm

    for name in ("RMSNorm", "LayerNorm"):
        config = copy.copy(_accepted_config())
        config.normalization = name
        check_model_config(config)
        assert ConsistentNorm(8, 1e-6, name, False).normalization == name
    config.normalization = "L2Norm"
    with pytest.raises(ConfigError, match="normalization='L2Norm'"):
        check_model_config(config)
    with pytest.raises(ConfigError, match="normalization='L2Norm'"):
        ConsistentNorm(8, 1e-6, "L2Norm", False)
    config = copy.copy(_accepted_config())
    config.layernorm_zero_centered_gamma = True
    with pytest.raises(ConfigError, match="layernorm_zero_centered_gamma"):
        check_model_config(config)


def test_recompute_modules_never_run_bitwise_are_refused_by_name():
    """Selective recomputation of core_attn and mlp runs bitwise (tests/test_honoured_fields.py);
    megatron's layernorm recomputation crashed without Transformer Engine (issue #55's launch), and
    the others checkpoint around the patched forward: refused naming the module."""
    config = copy.copy(_accepted_config())
    config.recompute_granularity, config.recompute_modules = "selective", ["core_attn", "mlp"]
    check_model_config(config)
    config.recompute_modules = ["core_attn", "layernorm"]
    with pytest.raises(ConfigError, match=r"recompute_modules=\['core_attn', 'layernorm'\]: \['layernorm'\]"):
        check_model_config(config)
    config.recompute_modules = ["moe"]
    with pytest.raises(ConfigError, match="recompute_modules containing 'moe'"):
        check_model_config(config)
    config.recompute_granularity = "full"  # the modules are unread
    check_model_config(config)


def test_yarn_with_a_partial_rotary_is_refused_naming_rotary_percent():
    """megatron's YarnRotaryEmbedding computes its table over the whole head whatever rotary_percent
    says: GPTModel(position_embedding_type='yarn', rotary_percent < 1) is refused naming it."""
    from mindspeed_tp.contract.model_arguments import check_gpt_model_arguments
    from mindspeed_tp.errors import ConfigError

    check_gpt_model_arguments({"position_embedding_type": "yarn", "rotary_percent": 1.0})
    with pytest.raises(ConfigError, match=r"rotary_percent=0\.5.*position_embedding_type='yarn'"):
        check_gpt_model_arguments({"position_embedding_type": "yarn", "rotary_percent": 0.5})
