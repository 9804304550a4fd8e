"""The MoE families users RL-train (issue #57), each from a tiny checkpoint transformers writes.
Mixtral: softmax over 8 experts, top-2 renormalised, an MoE block in every layer, no QK-norm, the
checkpoint's own expert names (block_sparse_moe, w1 / w3 / w2). GLM-4.5: a leading dense layer, then
sigmoid scores selected on score + a nonzero e_score_correction_bias, top-2 renormalised and scaled
by 2.5, a shared expert; QKV bias and RoPE on half of each head. DeepSeek-V3: GLM-4.5's MoE block with
4 groups of which 2 are kept, multi-latent attention with a query latent and YaRN; Moonlight's shape:
one query projection and plain RoPE (the MLA launches: tests/test_mla.py). For each: the reference engine and
Megatron's forward match transformers' own fp32 forward, every EP / expert-TP / TP layout gives
logprobs and routing bitwise the one-device result, the checkpoint exports back bit for bit, bitwise
training holds across layouts and the RL loop runs at ratio exactly 1. What a family does not model
is refused naming the config.json key."""
import dataclasses
import functools
import json

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.hf import hf_config_from_spec, open_hf_model, spec_from_hf_config
from mindspeed_tp.reference import ReferenceModel

from conftest import bits_equal, explain, full_tier, run_cli
from hf_models import make_deepseek_v3, make_glm4_moe, make_mixtral, save_word_tokenizer, transformers_logprobs
from test_families import (SEMANTICS_ATOL, _edited, _model_yaml, _sequences, _worst, assert_exports_back,
                           assert_ratio_exactly_one)

# family -> (checkpoint writer, spec changes that each drop one thing the family computes: each must
# fail the comparison with transformers by far)
FAMILIES = {
    "mixtral": (make_mixtral, [{"moe_router_pre_softmax": True}]),
    "glm45": (make_glm4_moe, [{"rotary_percent": 1.0}, {"moe_router_enable_expert_bias": False},
                              {"moe_router_topk_scaling_factor": None},
                              {"moe_shared_expert_intermediate_size": None}]),
    # MLA with a query latent and YaRN: without YaRN's softmax scale, without YaRN, without the groups
    "deepseek_v3": (make_deepseek_v3, [{"mscale_all_dim": 0.0}, {"rope_type": "rope"},
                                       {"moe_router_num_groups": None, "moe_router_group_topk": None},
                                       {"moe_shared_expert_intermediate_size": None}]),
    # Moonlight's shape: one query projection, plain RoPE (its base matters)
    "moonlight": (functools.partial(make_deepseek_v3, q_lora_rank=None, rope_scaling=None),
                  [{"rotary_base": 1000000.0}, {"moe_router_topk_scaling_factor": None}]),
}


T = "tests/test_families_moe.py::"


def _in_ci(ci, full, covered_by, why):
    """Parameters: ``ci`` in both tiers, ``full`` in the full tier only (covered by ``covered_by``)."""
    return list(ci) + [pytest.param(n, marks=full_tier(covered_by=T + covered_by, why=why)) for n in full]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-families")
    out = {}
    for name, (make, _) in FAMILIES.items():
        out[name] = make(str(root / name))
        save_word_tokenizer(out[name], 1000)
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_reference_engine_matches_transformers_fp32(checkpoints, name):
    """And what the family computes matters: without each piece (Mixtral's renormalised top-k; GLM's
    partial rotary, selection bias, scaling factor, shared expert) the comparison fails by far."""
    profile = load_profile()
    spec, weights = open_hf_model(checkpoints[name], profile)
    theirs = transformers_logprobs(checkpoints[name], _sequences())
    assert torch.cat(theirs).std() > 1.0, "logits too uniform for this check to detect a mapping error"
    ours = ReferenceModel.from_source(spec, profile, weights, torch.float32).score(_sequences())
    assert _worst(ours, theirs) < SEMANTICS_ATOL
    for change in FAMILIES[name][1]:
        broken = ReferenceModel.from_source(dataclasses.replace(spec, **change), profile, weights, torch.float32)
        assert _worst(broken.score(_sequences()), theirs) > 100 * SEMANTICS_ATOL, change


def _check(checkpoint, tmp_path, layouts, dtype, nproc):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(s) for s in _sequences()) + "\n")
    proc = run_cli("check", "--hf-checkpoint", checkpoint, "--prompts", str(prompts), "--layouts", layouts,
                   "--dtype", dtype, "--nproc", str(nproc), "--dump-logprobs", str(tmp_path / "dump"))
    assert proc.returncode == 0, explain(proc)
    dump = load_file(str(tmp_path / "dump" / "logprobs.safetensors"))
    for layout in layouts.split(","):
        assert bits_equal(dump[f"consistent/{layout}"], dump["consistent/reference"]), layout
        assert bits_equal(dump[f"consistent/routing/{layout}"], dump["consistent/routing/reference"]), layout
    return dump


@pytest.mark.parametrize("name", _in_ci(["glm45", "deepseek_v3"], ["mixtral", "moonlight"],
                                         "test_the_reference_engine_matches_transformers_fp32",
                                         "Mixtral's map is proved against transformers by the reference engine (CI "
                                         "tier) and its layouts by its engine test's EP layouts "
                                         "(tests/test_vllm_sampling.py); GLM-4.5's launch carries every MoE piece, "
                                         "DeepSeek-V3's MLA with a query latent and YaRN (Moonlight's one query "
                                         "projection: tests/test_mla.py's tiny-mla layouts)"))
def test_megatron_matches_transformers_and_ep_layouts_are_bitwise_fp32(checkpoints, tmp_path, name):
    """One checker launch: Megatron's TP=1 forward (the checker's reference) against transformers,
    tp2-sp-ep2 and tp1-ep2 against it bit for bit, logprobs and routing."""
    dump = _check(checkpoints[name], tmp_path, "tp2-sp-ep2,tp1-ep2", "fp32", 2)
    sequences = _sequences()
    for i, theirs in enumerate(transformers_logprobs(checkpoints[name], sequences)):
        ours = dump["consistent/reference"][i, : len(sequences[i]) - 1]
        assert (ours - theirs).abs().max() < SEMANTICS_ATOL, (i, (ours - theirs).abs().max())


@pytest.mark.parametrize("name", _in_ci(
    [], sorted(FAMILIES), "test_megatron_matches_transformers_and_ep_layouts_are_bitwise_fp32",
                                         "bf16 adds the casts every MoE model shares with Qwen3-MoE "
                                         "(tests/test_parity_moe.py) to the family's fp32 launch"))
def test_bf16_ep_etp_layouts_bitwise(checkpoints, tmp_path, name):
    """bf16 (where the routing is fragile: near-tied router logits) on four ranks: EP with TP and SP,
    EP 4 alone, expert-TP (tp1-ep2-dp2, a scoring replica of tp1-ep2, trains below)."""
    _check(checkpoints[name], tmp_path, "tp2-sp-ep2,tp1-ep4,tp2-sp-ep2-etp2", "bf16", 4)


@pytest.mark.parametrize("name", [pytest.param(n, marks=full_tier(
    covered_by="tests/test_mla.py::test_mla_rollouts_are_scored_bitwise",
    why="the same reference engine's rollouts at T=0.8 top-p 0.95 scored bitwise, for DeepSeek-V3's MoE block "
        "and MLA; the families' forwards are launched against one device in the CI tier")) for n in sorted(FAMILIES)])
def test_rollouts_are_scored_bitwise(checkpoints, tmp_path, name):
    """The reference rollout engine samples at T=0.8 with top-p 0.95 (processed logprobs); tp2-sp-ep2
    scores them bit for bit."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(s) for s in _sequences()) + "\n")
    proc = run_cli("check", "--hf-checkpoint", checkpoints[name], "--prompts", str(prompts), "--rollout", "6",
                   "--temperature", "0.8", "--top-p", "0.95", "--logprob-semantics", "processed",
                   "--max-new-tokens", "8", "--layouts", "tp2-sp-ep2", "--dtype", "bf16")
    assert proc.returncode == 0, explain(proc)
    assert "bitwise equal to the rollout engine" in proc.stdout, explain(proc)


@pytest.mark.parametrize("name", _in_ci(["glm45", "deepseek_v3"], ["mixtral", "moonlight"],
                                         "test_export_round_trip_bitwise",
                                         "the export writes every tensor through the map the import reads; "
                                         "Mixtral's and Moonlight's names are read back in their reference-engine "
                                         "tests"))
def test_export_round_trip_bitwise(checkpoints, tmp_path, name):
    """Experts sliced by EP and expert-TP written back under the family's own names, in shards."""
    assert_exports_back(checkpoints[name], tmp_path / "exported", "tp2-sp-ep2-etp2", 4)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_spec_to_config_json_and_back(checkpoints, name):
    spec, _ = open_hf_model(checkpoints[name], load_profile())
    assert spec_from_hf_config(hf_config_from_spec(spec, "float32"), spec.name) == spec


@pytest.mark.parametrize("name,change,named", [
    ("mixtral", {"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True"),
    ("mixtral", {"first_k_dense": 1}, "first_k_dense=1"),
    ("mixtral", {"qk_layernorm": True}, "qk_layernorm=True"),
    ("mixtral", {"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size"),
    ("mixtral", {"num_experts": None}, "has MoE layers"),
    ("mixtral", {"rotary_percent": 0.5}, "rotary_percent"),
    ("mixtral", {"moe_router_num_groups": 4, "moe_router_group_topk": 2}, "moe_router_num_groups"),
    ("glm45", {"moe_router_score_function": "softmax"}, "moe_router_score_function='softmax'"),
    ("glm45", {"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias=False"),
    ("glm45", {"moe_shared_expert_intermediate_size": 96}, "moe_shared_expert_intermediate_size=96"),
])
def test_a_spec_its_family_cannot_state_is_not_exported(checkpoints, name, change, named):
    spec, _ = open_hf_model(checkpoints[name], load_profile())
    with pytest.raises(ConfigError, match=named):
        hf_config_from_spec(dataclasses.replace(spec, **change))


@pytest.mark.parametrize("name", _in_ci(["glm45"], ["mixtral", "deepseek_v3", "moonlight"],
                                         "test_bitwise_training_two_layouts",
                                         "GLM-4.5 trains the routed experts Mixtral has plus the shared expert "
                                         "and the bias update; MLA's backward trains in tests/test_mla.py"))
def test_bitwise_training_two_layouts(checkpoints, tmp_path, name):
    """Every step's loss, gradients (router and experts among them) and logprobs bitwise across EP
    with TP and SP and EP across DP, with the alltoall dispatcher."""
    proc = run_cli("train-check", "--model", _model_yaml(tmp_path, checkpoints[name]),
                   "--layouts", "tp2-sp-ep2,tp1-ep2-dp2", "--dtype", "bf16", "--bitwise-training", "--steps", "2",
                   "--global-batch-size", "4", "--micro-batch-size", "1", "--seq-length", "32", timeout=1200)
    assert proc.returncode == 0, explain(proc)
    assert "bitwise" in proc.stdout.lower(), explain(proc)


@pytest.mark.parametrize("model", [pytest.param(m, marks=full_tier(
    covered_by="tests/test_mla.py::test_mla_rollouts_are_scored_bitwise",
    why="the RL loop is family-independent code (tests/test_rl_check.py) over the family's rollouts scored bitwise "
        "(DeepSeek-V3's in tests/test_mla.py) and its bitwise training step, each launched in the CI tier"))
    for m in ("tiny-deepseek-v3", "tiny-glm45", "tiny-mixtral")])
def test_rl_check_three_iterations_at_ratio_exactly_one(tmp_path, model):
    """GRPO against the reference engine sampling at T=0.8 with top-p 0.95 (processed logprobs),
    bitwise training at tp2-sp-ep2, resharded to tp1-ep2 after iteration 2 (the experts' state saved
    in one EP grid, loaded in another): every iteration's training logprobs equal the rollout's."""
    report = tmp_path / "rl.json"
    proc = run_cli("rl-check", "--model", model, "--layouts", "tp2-sp-ep2,tp1-ep2", "--reshard-at", "2",
                   "--iterations", "3", "--temperature", "0.8", "--top-p", "0.95", "--logprob-semantics", "processed",
                   "--bitwise-training", "--max-new-tokens", "32", "--json", str(report), timeout=1200)
    assert proc.returncode == 0, explain(proc)
    assert_ratio_exactly_one(report, iterations=3)


@pytest.mark.parametrize("name,changes,message", [
    ("glm45", {"norm_topk_prob": False}, "norm_topk_prob=false"),
    ("glm45", {"n_group": 4, "topk_group": 2}, "n_group / topk_group=4 / 2"),  # top-2 / 2 groups: not top-2 each
    ("glm45", {"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
    ("mixtral", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("mixtral", {"router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
    ("mixtral", {"attention_bias": True}, "attention_bias=true"),
    ("mixtral", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave=false"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias=true"),
    ("deepseek_v3", {"num_experts_per_tok": 2}, "n_group / topk_group=4 / 2"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "mscale_all_dim": 1.0, "rope_theta": 10000.0}}, "mscale_all_dim but no mscale"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "attention_factor": 1.2, "rope_theta": 10000.0}}, "attention_factor"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type='linear'"),
])
def test_what_a_family_does_not_model_is_refused_by_name(checkpoints, tmp_path, name, changes, message):
    directory = _edited(checkpoints[name], tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        open_hf_model(directory, load_profile())
    assert message in str(err.value)


def _with_mtp_layer(checkpoint, tmp_path, mtp_layers):
    """A copy whose config.json declares ``mtp_layers`` and whose weights carry an extra layer past
    num_hidden_layers (as GLM-4.5's and DeepSeek-V3's checkpoints ship their MTP layer)."""
    from safetensors.torch import save_file

    directory = _edited(checkpoint, tmp_path, num_nextn_predict_layers=mtp_layers)
    layers = json.load(open(f"{directory}/config.json"))["num_hidden_layers"]
    extra = {f"model.layers.{layers}.eh_proj.weight": torch.ones(128, 256),
             f"model.layers.{layers}.enorm.weight": torch.ones(128)}
    save_file(extra, f"{directory}/model-mtp.safetensors", metadata={"format": "pt"})
    index = json.load(open(f"{directory}/model.safetensors.index.json"))
    index["weight_map"].update({n: "model-mtp.safetensors" for n in extra})
    json.dump(index, open(f"{directory}/model.safetensors.index.json", "w"))
    return directory


def test_glms_multi_token_prediction_layer_is_dropped_with_a_note(checkpoints, tmp_path, capfd):
    """The MTP layer's tensors are not loaded (a note says so) and the model is the one without them."""
    directory = _with_mtp_layer(checkpoints["glm45"], tmp_path, 1)
    spec, weights = open_hf_model(directory, load_profile())
    assert "multi-token-prediction layer(s) [3] (2 tensors) are not loaded" in capfd.readouterr().err
    plain_spec, plain = open_hf_model(checkpoints["glm45"], load_profile())
    assert dataclasses.replace(spec, name=plain_spec.name) == plain_spec
    ours = ReferenceModel.from_source(spec, load_profile(), weights, torch.float32).score(_sequences()[:2])
    theirs = ReferenceModel.from_source(plain_spec, load_profile(), plain, torch.float32).score(_sequences()[:2])
    assert all(bits_equal(a, b) for a, b in zip(ours, theirs))


def test_an_mtp_layer_config_json_does_not_declare_is_refused(checkpoints, tmp_path):
    directory = _with_mtp_layer(checkpoints["glm45"], tmp_path, 0)
    with pytest.raises(ConfigError, match=r"unexpected tensor\(s\) \['model.layers.3.eh_proj.weight'"):
        open_hf_model(directory, load_profile())


def test_an_extra_layer_in_a_family_without_mtp_is_refused(checkpoints, tmp_path):
    directory = _with_mtp_layer(checkpoints["mixtral"], tmp_path, 1)
    with pytest.raises(ConfigError, match=r"unexpected tensor\(s\) \['model.layers.2.eh_proj.weight'"):
        open_hf_model(directory, load_profile())


def test_glms_group_limited_routing_matches_transformers(tmp_path):
    """n_group 4 / topk_group 2 over 16 experts, top-4 (DeepSeek-V3's top-2-per-group group score):
    the reference engine matches transformers; without the groups it does not. (transformers masks the
    dropped groups' scores to 0.0, megatron to -inf: they differ only where fewer than top-k kept
    candidates score above 0, which the 8 kept candidates here make unlikely -- the match shows it.)"""
    directory = make_glm4_moe(str(tmp_path / "glm-groups"), n_routed_experts=16, n_group=4, topk_group=2,
                              num_experts_per_tok=4)
    profile = load_profile()
    spec, weights = open_hf_model(directory, profile)
    assert (spec.moe_router_num_groups, spec.moe_router_group_topk) == (4, 2)
    theirs = transformers_logprobs(directory, _sequences())
    ours = ReferenceModel.from_source(spec, profile, weights, torch.float32).score(_sequences())
    assert _worst(ours, theirs) < SEMANTICS_ATOL
    ungrouped = dataclasses.replace(spec, moe_router_num_groups=None, moe_router_group_topk=None)
    broken = ReferenceModel.from_source(ungrouped, profile, weights, torch.float32).score(_sequences())
    assert _worst(broken, theirs) > 100 * SEMANTICS_ATOL
    assert spec_from_hf_config(hf_config_from_spec(spec, "float32"), spec.name) == spec


def test_deepseek_v3_checkpoints_name_their_router_as_deepseeks_own_config_does():
    """transformers' deepseek_v3 always runs the sigmoid router with the expert bias and ignores
    ``scoring_func`` / ``topk_method``; vLLM reads them (without them: softmax scores, no bias). Export
    writes DeepSeek-V3's values; import refuses any other by name."""
    from mindspeed_tp.families import deepseek_v3
    from mindspeed_tp.models.spec import load_model_spec

    cfg = deepseek_v3.hf_config(load_model_spec("tiny-deepseek-v3-mla576"), "bfloat16")
    assert (cfg["scoring_func"], cfg["topk_method"]) == ("sigmoid", "noaux_tc")
    assert deepseek_v3.spec_fields(cfg, "DeepseekV3ForCausalLM", "m", "config.json")["moe_router_enable_expert_bias"]
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        with pytest.raises(ConfigError, match=f"{key}='{value}' is not supported"):
            deepseek_v3.spec_fields(dict(cfg, **{key: value}), "DeepseekV3ForCausalLM", "m", "config.json")
