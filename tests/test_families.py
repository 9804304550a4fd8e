"""The dense families users RL-train (issue #56), each from a tiny checkpoint transformers writes:
Qwen2 / Qwen2.5 (QKV bias, no QK-norm, tied embeddings), Llama-3.1 (llama3-scaled RoPE, no QK-norm,
GQA, untied), Llama-3.2 (the same, tied, factor 32) and Mistral (a sliding window shorter than the
prompts, Mistral-Nemo's head size other than hidden / heads). For each: the reference engine and
Megatron's forward match transformers' own fp32 forward, every layout is bitwise the one-device
result, the checkpoint exports back bit for bit, and bitwise training holds across layouts. What the
families do not model is refused naming the config.json key."""
import json
import os
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.hf import SafetensorsCheckpoint, open_hf_model, spec_from_hf_config
from mindspeed_tp.reference import ReferenceModel

from conftest import bits_equal, explain, full_tier, on_every_line_in_the_full_tier, run_cli, run_torchrun
from hf_models import make_llama, make_mistral, make_qwen2, save_word_tokenizer, transformers_logprobs

SEMANTICS_ATOL = 1e-4  # as tests/test_hf_checkpoint.py: a few ulp per op through two layers
# Qwen2.5 / Qwen3's long-context YaRN (their model cards: factor 4), over an original context of 64 positions
# so that the test prompts cross the interpolated band; the ramp's ends unrounded (truncate false, gpt-oss')
QWEN25_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": False}
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
FAMILIES = {
    "qwen2": (make_qwen2, {}),
    "llama31": (make_llama, {}),
    "llama32": (make_llama, {"tie_word_embeddings": True, "rope_scaling": LLAMA32_ROPE}),
    "mistral": (make_mistral, {}),
    "qwen25_yarn": (make_qwen2, {"rope_scaling": QWEN25_YARN}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (make, overrides) in FAMILIES.items():
        out[name] = make(str(root / name), **overrides)
        save_word_tokenizer(out[name], 1000)
    return out


def _sequences():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (3, 17, 64, 150)]


def _worst(ours, theirs):
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_reference_engine_matches_transformers_fp32(checkpoints, name):
    """And the family's own feature matters: without the QKV bias or the RoPE scaling the same
    comparison fails by far (so the match is not a tolerance hiding a dropped piece)."""
    profile = load_profile()
    spec, weights = open_hf_model(checkpoints[name], profile)
    theirs = transformers_logprobs(checkpoints[name], _sequences())
    assert torch.cat(theirs).std() > 1.0, "logits too uniform for this check to detect a mapping error"
    ours = ReferenceModel.from_source(spec, profile, weights, torch.float32).score(_sequences())
    assert _worst(ours, theirs) < SEMANTICS_ATOL
    import dataclasses

    if spec.rope_type == "yarn":  # plain RoPE, and YaRN's frequencies without its concentration factor
        plain = ReferenceModel.from_source(dataclasses.replace(spec, rope_type="rope"), profile, weights, torch.float32)
        assert _worst(plain.score(_sequences()), theirs) > 100 * SEMANTICS_ATOL
        broken = ReferenceModel.from_source(dataclasses.replace(spec, mscale=0.0), profile, weights, torch.float32)
        assert broken.rope_mscale == 1.0
    elif spec.add_qkv_bias:
        broken = ReferenceModel.from_source(spec, profile, weights, torch.float32)
        for key in [k for k in broken.w if k.endswith("linear_qkv.bias")]:
            broken.w[key] = torch.zeros_like(broken.w[key])
    elif spec.sliding_window is not None:
        full = dataclasses.replace(spec, sliding_window=None)
        broken = ReferenceModel.from_source(full, profile, weights, torch.float32)
    else:
        assert spec.rope_scaling_factor is not None
        plain = dataclasses.replace(spec, rope_scaling_factor=None)
        broken = ReferenceModel.from_source(plain, profile, weights, torch.float32)
    assert _worst(broken.score(_sequences()), theirs) > 100 * SEMANTICS_ATOL


@pytest.mark.parametrize("name", ["llama31", "mistral", "qwen2", "qwen25_yarn", pytest.param("llama32", marks=full_tier(
    covered_by="tests/test_families.py::test_the_reference_engine_matches_transformers_fp32",
    why="Llama-3.2 is Llama-3.1's code with a tied head and another factor: its mapping against transformers runs "
        "in the reference-engine test (CI tier), the layouts in llama31's launch"))])
@on_every_line_in_the_full_tier  # the window on 0.12, the RoPE-scaling arguments, the bias
def test_megatron_matches_transformers_and_every_layout_is_bitwise_fp32(checkpoints, tmp_path, name):
    """One checker launch: Megatron's TP=1 forward (the checker's reference) against transformers,
    and tp2-sp / tp1-pp2 against it bit for bit."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(s) for s in _sequences()) + "\n")
    layouts = "tp2-sp,tp1-pp2,tp2-sp-cp2" if name == "qwen25_yarn" else "tp2-sp,tp1-pp2"
    proc = run_cli("check", "--hf-checkpoint", checkpoints[name], "--prompts", str(prompts), "--layouts", layouts,
                   "--dtype", "fp32", "--dump-logprobs", str(tmp_path / "dump"))
    if name == "qwen25_yarn" and not _gpt_model_has_yarn():  # megatron-core 0.12: no GPTModel YaRN, named
        assert proc.returncode == 2 and "no position_embedding_type 'yarn'" in proc.stderr, explain(proc)
        return
    assert proc.returncode == 0, explain(proc)
    dump = load_file(str(tmp_path / "dump" / "logprobs.safetensors"))
    reference = dump["consistent/reference"]
    for layout in layouts.split(","):
        assert bits_equal(dump[f"consistent/{layout}"], reference), layout
    sequences = _sequences()
    for i, theirs in enumerate(transformers_logprobs(checkpoints[name], sequences)):
        ours = reference[i, : len(sequences[i]) - 1]
        assert (ours - theirs).abs().max() < SEMANTICS_ATOL, (i, (ours - theirs).abs().max())


def _gpt_model_has_yarn() -> bool:
    from mindspeed_tp import compat

    return compat.gpt_model_has_yarn()


@pytest.mark.parametrize("name", [pytest.param(n, marks=full_tier(
    covered_by="tests/test_families.py::test_megatron_matches_transformers_and_every_layout_is_bitwise_fp32",
    why="the same family code at bf16: the fp32 launch shows the mapping and layout invariance; bf16 adds the "
        "casts every family shares with Qwen3 (test_parity_dense.py)")) for n in sorted(FAMILIES)])
def test_bf16_layouts_bitwise(checkpoints, tmp_path, name):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(s) for s in _sequences()) + "\n")
    layouts = "tp2-sp-pp2,tp4-sp"
    proc = run_cli("check", "--hf-checkpoint", checkpoints[name], "--prompts", str(prompts), "--layouts", layouts,
                   "--dtype", "bf16", "--nproc", "4", "--dump-logprobs", str(tmp_path / "dump"))
    assert proc.returncode == 0, explain(proc)
    dump = load_file(str(tmp_path / "dump" / "logprobs.safetensors"))
    for layout in layouts.split(","):
        assert bits_equal(dump[f"consistent/{layout}"], dump["consistent/reference"]), layout


_ROLLOUT_FULL = full_tier(
    covered_by="tests/test_families.py::test_rollouts_are_scored_bitwise",
    why="the CI tier's Mistral run decodes past its window (the one family whose decode differs); the bias and the "
        "scaled RoPE reach the decode through the same reference-model code as the prefill, scored in the fp32 "
        "launches, and against the real vLLM in tests/test_vllm_sampling.py")


@pytest.mark.parametrize("name,profile", [("mistral", "default"), pytest.param("qwen2", "default", marks=_ROLLOUT_FULL),
                                          pytest.param("llama31", "rollout-tp2", marks=_ROLLOUT_FULL),
                                          pytest.param(
    "llama32", "default", marks=full_tier(
        covered_by="tests/test_families.py::test_rollouts_are_scored_bitwise",
        why="Llama-3.2 differs from 3.1 by the tied head and the factor, both in the fp32 launch against "
            "transformers"))])
def test_rollouts_are_scored_bitwise(checkpoints, tmp_path, name, profile):
    """The reference rollout engine samples at T=0.8 with top-p 0.95 (processed logprobs); a sharded
    layout scores them bit for bit -- under ``rollout-tp2`` the engine is the TP-2 emulation. The
    prompts (3 to 150 tokens) run the paged decode past Mistral's 24-key window and a key block."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(s) for s in _sequences()) + "\n")
    proc = run_cli("check", "--hf-checkpoint", checkpoints[name], "--prompts", str(prompts), "--profile", profile,
                   "--rollout", "6",
                   "--temperature", "0.8", "--top-p", "0.95", "--logprob-semantics", "processed",
                   "--max-new-tokens", "8", "--layouts", "tp2-sp", "--dtype", "bf16")
    assert proc.returncode == 0, explain(proc)
    assert "bitwise equal to the rollout engine" in proc.stdout, explain(proc)


_EXPORT_FULL = full_tier(
    covered_by="tests/test_families.py::test_export_round_trip_bitwise",
    why="the export's regrouped tensors are Qwen2's biases (CI tier); Llama's and Mistral's tensors are Qwen3's "
        "names less the QK-norm, and their config.json round trip runs in test_spec_to_config_json_and_back")


@pytest.mark.parametrize("name,layout", [("qwen2", "tp2-sp-pp2"), pytest.param("llama32", "tp2-sp", marks=_EXPORT_FULL),
                                         pytest.param("mistral", "tp2-sp", marks=_EXPORT_FULL)])
def test_export_round_trip_bitwise(checkpoints, tmp_path, name, layout):
    """The QKV biases (sliced by TP and regrouped per query group) and the RoPE scaling in config.json."""
    assert_exports_back(checkpoints[name], tmp_path / "exported", layout, 4 if "pp2" in layout else 2)


def assert_exports_back(checkpoint, out, layout, nproc):
    """The checkpoint loaded at ``layout`` and exported to ``out``: every tensor bit for bit, the same
    names, and transformers' forward of the export bit for bit the original's."""
    proc = run_torchrun("hf_export.py", nproc, checkpoint, layout, "fp32", str(out))
    assert proc.returncode == 0, explain(proc)
    original, exported = SafetensorsCheckpoint(checkpoint), SafetensorsCheckpoint(str(out))
    assert exported.names() == original.names()
    for tensor in original.names():
        assert bits_equal(original.read(tensor), exported.read(tensor)), tensor
    seq = [_sequences()[2]]
    assert bits_equal(transformers_logprobs(str(out), seq)[0], transformers_logprobs(checkpoint, seq)[0])


@pytest.mark.parametrize("name", ["qwen2", "llama32", "mistral", "qwen25_yarn"])
def test_spec_to_config_json_and_back(checkpoints, name):
    from mindspeed_tp.hf import hf_config_from_spec

    spec, _ = open_hf_model(checkpoints[name], load_profile())
    assert spec_from_hf_config(hf_config_from_spec(spec, "float32"), spec.name) == spec


@pytest.mark.parametrize("name,change,named", [
    ("qwen2", {"add_qkv_bias": False}, "add_qkv_bias=False"),
    ("qwen2", {"sliding_window": 8}, "sliding_window"),
    ("llama32", {"qk_layernorm": True}, "qk_layernorm=True"),
    ("mistral", {"rope_scaling_factor": 8.0}, "rope_scaling_factor"),
    ("mistral", {"rope_type": "yarn", "original_max_position_embeddings": 64}, "yarn"),
])
def test_a_spec_its_family_cannot_state_is_not_exported(checkpoints, name, change, named):
    """Export writes a family's config.json only for what the architecture computes: a field its
    architecture fixes otherwise, or a feature it has no key for, is a ConfigError naming it."""
    import dataclasses

    from mindspeed_tp.hf import hf_config_from_spec

    spec, _ = open_hf_model(checkpoints[name], load_profile())
    with pytest.raises(ConfigError, match=rf"{named}.* cannot be written as a"):
        hf_config_from_spec(dataclasses.replace(spec, **change))


def _model_yaml(tmp_path, checkpoint):
    """The checkpoint's spec as a model YAML (the checkers' --model), seeded weights."""
    spec, _ = open_hf_model(checkpoint, load_profile())
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in spec.to_dict().items() if v is not None}))
    return str(path)


@pytest.mark.parametrize("name", ["mistral", pytest.param("qwen2", marks=full_tier(
    covered_by="tests/test_families_moe.py::test_bitwise_training_two_layouts",
    why="the QKV bias gradient is GLM-4.5's too, trained bitwise in the CI tier (tests/test_families_moe.py)")),
    pytest.param("llama31", marks=full_tier(
        covered_by="tests/test_families.py::test_bitwise_training_two_layouts",
        why="Llama's difference is the RoPE table, which training reads as the scoring forward does (the fp32 "
            "launch); the CI tier trains Mistral's windowed attention backward")),
    pytest.param("qwen25_yarn", marks=full_tier(
        covered_by="tests/test_families.py::test_megatron_matches_transformers_and_every_layout_is_bitwise_fp32",
        why="YaRN changes RoPE's table and its cos / sin scale, which the backward reads as the forward does (the "
            "same apply_rope, differentiated by autograd); the fp32 launch shows them bitwise across TP / PP / CP"))])
@on_every_line_in_the_full_tier  # the window on 0.12, the RoPE-scaling arguments, the bias
def test_bitwise_training_two_layouts(checkpoints, tmp_path, name):
    """Every step's loss, gradients (the QKV bias's among them) and logprobs bitwise across layouts."""
    proc = run_cli("train-check", "--model", _model_yaml(tmp_path, checkpoints[name]), "--layouts", "tp2-sp,tp1-pp2",
                   "--dtype", "fp32", "--bitwise-training", "--steps", "2", "--global-batch-size", "4",
                   "--micro-batch-size", "1", "--seq-length", "32", timeout=1200)
    if name == "qwen25_yarn" and not _gpt_model_has_yarn():  # megatron-core 0.12: no GPTModel YaRN, named
        assert proc.returncode == 2 and "no position_embedding_type 'yarn'" in proc.stderr, explain(proc)
        return
    assert proc.returncode == 0, explain(proc)
    assert "bitwise" in proc.stdout.lower(), explain(proc)


_RL_FULL = full_tier(
    covered_by="tests/test_rl_check.py::test_every_iteration_bitwise_equal_to_the_engine",
    why="the RL loop is family-independent code over the family's forward and training step, each tested per "
        "family above (Mistral's window in its rollouts: test_rollouts_are_scored_bitwise, in its training: "
        "test_bitwise_training_two_layouts); the CI tier runs the loop for Qwen3 and DeepSeek-V3")


@pytest.mark.parametrize("model", [pytest.param(m, marks=_RL_FULL) for m in ("tiny-mistral", "tiny-qwen2", "tiny-llama")])
def test_rl_check_three_iterations_at_ratio_exactly_one(tmp_path, model):
    """GRPO against the reference engine sampling at T=0.8 with top-p 0.95 (processed logprobs),
    bitwise training at tp2-sp: every iteration's training logprobs equal the rollout's."""
    report = tmp_path / "rl.json"
    proc = run_cli("rl-check", "--model", model, "--layout", "tp2-sp", "--iterations", "3", "--temperature", "0.8",
                   "--top-p", "0.95", "--logprob-semantics", "processed", "--bitwise-training", "--max-new-tokens", "32",
                   "--json", str(report), timeout=1200)
    assert proc.returncode == 0, explain(proc)
    assert_ratio_exactly_one(report, iterations=3)


def assert_ratio_exactly_one(report, iterations):
    """An rl-check report: every iteration (1..``iterations``) bitwise the rollout's logprobs, in the
    forward-only pass and in the training step, and the policy really moving (the groups' rewards
    differ: advantages not all zero)."""
    (arm,) = json.loads(report.read_text())["arms"]
    rows = arm["iterations"]
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))
    for r in rows:
        assert r["bitwise_fraction"] == 1.0 and r["step_bitwise_fraction"] == 1.0, r
        assert r["max_abs_logdiff"] == 0.0 and r["max_abs_ratio_minus_1"] == 0.0, r
    groups = [r["rewards"][i:i + 4] for r in rows for i in range(0, len(r["rewards"]), 4)]
    assert any(len(set(g)) > 1 for g in groups)


# -- what the families do not model: refused naming the key ----------------------------------------

def _edited(checkpoint, tmp_path, **changes):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint, directory)
    path = os.path.join(directory, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))
    return directory


@pytest.mark.parametrize("name,changes,message", [
    ("llama31", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type='linear'"),
    ("llama31", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ("llama31", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type='longrope'"),
    ("llama31", {"rope_scaling": dict(LLAMA32_ROPE, original_max_position_embeddings=4096)},
     "rope_scaling.original_max_position_embeddings=4096"),
    ("llama31", {"rope_scaling": dict(LLAMA32_ROPE, high_freq_factor=2.0)}, "rope_scaling.high_freq_factor=2.0"),
    ("llama31", {"attention_bias": True}, "attention_bias=true"),
    ("llama31", {"mlp_bias": True}, "mlp_bias=true"),
    ("llama31", {"pretraining_tp": 2}, "pretraining_tp=2"),
    ("qwen2", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type='llama3'"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen2", {"architectures": ["Gemma2ForCausalLM"]}, "architectures=['Gemma2ForCausalLM'] is not supported"),
    ("mistral", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
])
def test_what_a_family_does_not_model_is_refused_by_name(checkpoints, tmp_path, name, changes, message):
    directory = _edited(checkpoints[name], tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        open_hf_model(directory, load_profile())
    assert message in str(err.value)


def test_the_checker_exits_2_naming_the_key(checkpoints, tmp_path):
    directory = _edited(checkpoints["llama31"], tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    proc = run_cli("check", "--hf-checkpoint", directory, "--layouts", "tp1")
    assert proc.returncode == 2 and "rope_scaling.rope_type='yarn'" in proc.stderr, explain(proc)


def test_megatron_computes_the_references_llama3_frequencies():
    """The reference engine's scaled inv_freq is megatron-core's RotaryEmbedding's, bit for bit."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mindspeed_tp.kernels import rope_inv_freq

    for dim, base, factor in ((32, 500000, 8.0), (128, 500000, 32.0), (64, 10000, 8.0)):
        theirs = RotaryEmbedding(dim, 1.0, rotary_base=base, rope_scaling=True, rope_scaling_factor=factor,
                                 use_cpu_initialization=True).inv_freq
        ours = rope_inv_freq(dim, base, factor)
        assert bits_equal(ours, theirs), (dim, base, factor)
        assert not bits_equal(ours, rope_inv_freq(dim, base)), "the scaling changed nothing at this head size"

