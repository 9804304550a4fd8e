"""The verl entry point (VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl) against the real verl 0.9 and
mbridge packages (installed by scripts/setup_env.sh on the 0.16.x and 0.19.x lines).

Real verl code exercised: ``import verl`` (its external-module import), mbridge's layer spec and
weight loading as verl's engine drives them (``verl.utils.megatron_utils.make_megatron_module``
with a vanilla mbridge ``AutoBridge``), the engine forward ``gptmodel_forward_model_engine``
(packed thd sequences, verl's own packing) and ``MegatronEngineWithLMHead._lm_head_logits_processor``
(temperature in place, then ``vocab_parallel_log_probs_from_logits``). On megatron-core 0.19
mbridge 0.15.1 cannot build models (upstream: it uses the removed ``ModelType.encoder_and_decoder``),
so there the engine forward runs on mindspeed-tp's builder and the mbridge assertions check that
this is still so. Not exercised: the Ray
workers and ``MegatronEngine.__init__`` (device mesh, optimizer, checkpoint manager: GPU/Ray
machinery), so the logits processor runs on an engine object without that state -- it reads none
when entropy and distillation are off."""
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, bits_equal, explain, run_python, run_torchrun
from hf_models import make_qwen3, make_qwen3_moe

ENV = {"VERL_USE_EXTERNAL_MODULES": "mindspeed_tp.verl"}
PROFILES = ("default", "rollout-tp1")
MODELS = ("qwen3", "qwen3-moe")
# mbridge loads the local spec's SequentialMLP experts at TP = EP = 1 only (refused beyond, tested)
LAYOUTS = {"qwen3": ("tp1", "tp2-sp"), "qwen3-moe": ("tp1",)}


def test_fresh_process_with_only_the_environment_variable():
    """`import verl` in a fresh process, nothing else: every patch applied; mbridge's and verl's
    request for the Transformer Engine layer spec answered with the local one (TE is not installed
    here: the TE spec would not build), with the original signature (vp_stage) visible; verl's
    fused-kernel forward refused by name."""
    code = (
        "import inspect, verl, mindspeed_tp\n"
        "from mindspeed_tp.patches import registry\n"
        "reg = registry()\n"
        "print('ENABLED', mindspeed_tp.is_enabled(), sum(p.applied for p in reg.patches) == len(reg.patches))\n"
        "from mindspeed_tp.check.driver import setup_parallel_state, init_distributed\n"
        "from mindspeed_tp.models.layout import Layout\n"
        "from mindspeed_tp.devices.cpu_shims import install_cpu_shims\n"
        "init_distributed(); install_cpu_shims()  # this CPU-only test process: megatron's CUDA calls\n"
        "setup_parallel_state(Layout(), 0)  # the spec reads the pipeline rank\n"
        "from megatron.core.transformer.transformer_config import TransformerConfig\n"
        "from mbridge.core import llm_bridge\n"
        "from verl.models.mcore import model_initializer\n"
        "cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization='RMSNorm')\n"
        "for fn in (llm_bridge.get_gpt_decoder_block_spec, model_initializer.get_gpt_decoder_block_spec):\n"
        "    spec = fn(cfg, use_transformer_engine=True, vp_stage=None)\n"
        "    print('SPEC', spec.layer_specs[0].submodules.self_attention.submodules.core_attention.__name__,\n"
        "          'vp_stage' in inspect.signature(fn).parameters)\n"
        "from verl.models.mcore.model_forward_fused import patch_fused_forward\n"
        "try:\n"
        "    patch_fused_forward(None)\n"
        "except mindspeed_tp.ConfigError as exc:\n"
        "    print('FUSED', exc)\n"
    )
    proc = run_python(code, env=ENV)
    assert proc.returncode == 0, explain(proc)
    assert "ENABLED True True" in proc.stdout
    assert proc.stdout.count("SPEC DotProductAttention True") == 2
    assert "FUSED actor_rollout_ref.model.use_fused_kernels=True" in proc.stdout


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """One launch: tests/workers/verl_engine.py over a dense and a MoE checkpoint written by
    transformers, vocab 1000: mbridge (make_vocab_size_divisible_by=128) and mindspeed-tp's builder
    pad the model to 1024, so verl's logprob must exclude the padded columns by the true size the
    logits carry."""
    tmp = tmp_path_factory.mktemp("verl")
    dense = make_qwen3(str(tmp / "qwen3"), vocab_size=1000)
    moe = make_qwen3_moe(str(tmp / "qwen3-moe"), vocab_size=1000, mlp_only_layers=[])  # mbridge: every layer MoE
    proc = run_torchrun("verl_engine.py", 2, str(tmp / "out.safetensors"), dense, moe, env=ENV, timeout=900)
    assert proc.returncode == 0, explain(proc)
    return load_file(str(tmp / "out.safetensors"))


def _scored(t, model):
    """Entries that score a next token of the same sequence (verl's last label wraps around)."""
    lengths = t[f"lengths/{model}"].tolist()
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, : n - 1] = True
    return mask


def _mbridge_usable(engine_run) -> bool:
    """mbridge 0.15.1 builds with ModelType.encoder_and_decoder, removed in megatron-core 0.19: on
    that line it cannot build any model (upstream, with or without mindspeed-tp)."""
    from mindspeed_tp.compat import megatron_line

    usable = bool(int(engine_run["mbridge_usable"]))
    assert usable == (megatron_line() < (0, 19))  # fails once mbridge supports 0.19: then test it there
    return usable


def test_mbridge_loads_the_same_weights_as_mindspeed_tp_hf(engine_run):
    keys = [k for k in engine_run if k.startswith("weights_equal/")]
    expected = sum(len(layouts) for layouts in LAYOUTS.values()) * len(PROFILES)
    assert len(keys) == (expected if _mbridge_usable(engine_run) else 0)
    assert all(int(engine_run[k]) == 1 for k in keys), [k for k in keys if int(engine_run[k]) != 1]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("model", MODELS)
def test_verl_engine_logprob_equals_the_engine_in_every_layout(engine_run, model, profile):
    """Canonical tree: the reference engine follows the same tree; rollout-tp1: the reference engine
    runs as a stock TP=1 engine (full-vocab fp32 log-softmax), which verl's logprob call, routed per
    profile by mindspeed-tp, matches. Dense: TP=2/SP bitwise equal to TP=1."""
    m = _scored(engine_run, model)
    engine = engine_run[f"engine/{model}/{profile}"][m]
    for layout in LAYOUTS[model]:
        lp = engine_run[f"lp/{model}/{profile}/{layout}"][m]
        assert torch.isfinite(lp).all() and (lp < 0).all()
        assert bits_equal(lp, engine), layout


def test_mbridge_moe_beyond_tp1_is_refused_by_name(engine_run):
    keys = [k for k in engine_run if k.startswith("refused/")]
    assert len(keys) == (len(PROFILES) if _mbridge_usable(engine_run) else 0)
    assert all(int(engine_run[k]) == 1 for k in keys)


@pytest.mark.parametrize("model", MODELS)
def test_the_two_profiles_are_told_apart(engine_run, model):
    """The comparison above can fail: the canonical tree and the stock engine differ on some tokens."""
    m = _scored(engine_run, model)
    assert not bits_equal(engine_run[f"lp/{model}/default/tp1"][m], engine_run[f"lp/{model}/rollout-tp1/tp1"][m])


def test_megatron_bridge_provider_builds_the_local_spec():
    """Megatron-Bridge (verl's vanilla_mbridge=False path) needs Python >= 3.12: against a stand-in
    with its published GPTModelProvider.provide and spec functions (tests/fakes/megatron_bridge_standin,
    see its docstring), a provider holding the default Transformer Engine spec builds a local-spec
    GPTModel while mindspeed-tp is enabled (TE is not installed: the TE spec would not build), and
    provide() keeps its signature."""
    code = (
        "import inspect, torch, mindspeed_tp\n"
        "from mindspeed_tp.check.driver import setup_parallel_state, init_distributed\n"
        "from mindspeed_tp.models.layout import Layout\n"
        "from mindspeed_tp.devices.cpu_shims import install_cpu_shims\n"
        "init_distributed(); mindspeed_tp.enable(); install_cpu_shims(); setup_parallel_state(Layout(), 0)\n"
        "from megatron.bridge.models import gpt_provider\n"
        "p = gpt_provider.GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,\n"
        "    normalization='RMSNorm', add_bias_linear=False, use_cpu_initialization=True, vocab_size=1024,\n"
        "    gated_linear_unit=True, activation_func=torch.nn.functional.silu,\n"
        "    seq_length=64, position_embedding_type='rope')\n"
        "model = p.provide()\n"
        "core = model.decoder.layers[0].self_attention.core_attention\n"
        "print('CORE', type(core).__name__, p.transformer_layer_spec is gpt_provider.local_layer_spec)\n"
        "print('SIG', list(inspect.signature(gpt_provider.GPTModelProvider.provide).parameters))\n"
    )
    proc = run_python(code, env={"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "fakes",
                                                                                   "megatron_bridge_standin")])})
    assert proc.returncode == 0, explain(proc)
    assert "CORE DotProductAttention True" in proc.stdout
    assert "SIG ['self', 'pre_process', 'post_process', 'vp_stage']" in proc.stdout


_PROCESSOR_SNIPPET = (
    "import torch, verl, mindspeed_tp\n"
    "from mindspeed_tp.check.driver import setup_parallel_state, init_distributed\n"
    "from mindspeed_tp.models.layout import Layout\n"
    "from mindspeed_tp.devices.cpu_shims import install_cpu_shims\n"
    "init_distributed(); install_cpu_shims(); setup_parallel_state(Layout(), 0)\n"
    "from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead\n"
    "from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits as logprob\n"
    "mindspeed_tp.set_vocab_size(100)\n"
    "gen = torch.Generator().manual_seed(0)\n"
    "logits = (torch.randn(2, 9, 128, generator=gen) * 4).bfloat16()\n"
    "labels = torch.randint(0, 100, (2, 9), generator=gen)\n"
    "engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)  # the processor reads no state here\n"
    "try:\n"
    "    got = engine._lm_head_logits_processor(logits.clone(), labels, torch.full((2, 9), 0.7),\n"
    "        calculate_sum_pi_squared=False, calculate_entropy=False, distillation_use_topk=False,\n"
    "        distillation_only=False, logits_processor_func=None, batch=None, data_format='bshd')['log_probs']\n"
    "except mindspeed_tp.ConfigError as exc:\n"
    "    print('REFUSED', exc); raise SystemExit(0)\n"
    "t = torch.tensor(0.7)\n"
    "engine_way = logprob(logits.float() / t, labels)  # vLLM: fp32 logits, then / T\n"
    "in_bf16 = logprob((logits / t.bfloat16()).float(), labels)  # verl's in-place division left in bf16\n"
    "print('AS_THE_ENGINE', torch.equal(got.view(torch.int32), engine_way.view(torch.int32)),\n"
    "      torch.equal(in_bf16.view(torch.int32), engine_way.view(torch.int32)))\n"
)


def test_verls_temperature_division_runs_on_fp32_logits_as_the_engines_does():
    """verl's LM-head logits processor divides the logits by the temperature in place, in their
    dtype: with a real engine's bf16 logits that rounds to bf16 and differs from the engine, which
    divides fp32 logits. Through the verl entry the processor's result is the engine's division."""
    proc = run_python(_PROCESSOR_SNIPPET, env=ENV)
    assert proc.returncode == 0, explain(proc)
    assert "AS_THE_ENGINE True False" in proc.stdout


def test_a_profile_asking_verl_for_processed_logprobs_is_refused(tmp_path):
    profile = tmp_path / "processed.yaml"
    profile.write_text("name: processed\nlogprob_semantics: processed\n")
    proc = run_python(_PROCESSOR_SNIPPET, env=dict(ENV, MINDSPEED_TP_PROFILE=str(profile)))
    assert proc.returncode == 0, explain(proc)
    assert "REFUSED" in proc.stdout and "logprob_semantics" in proc.stdout and "top_p=1.0" in proc.stdout
