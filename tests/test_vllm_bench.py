"""scale_bench's ``engine`` mode: the real-engine profile vllm-cpu-tp2 (vLLM's kernels; a MoE's
experts computed by engine slice, no rank holding every expert) runs end to end next to vanilla
with ``--forward-only``: each mode's forward time and forward peak, no step fields. Runs only in
.venv-vllm (scripts/test.sh); conftest.py leaves this file out where vLLM is not installed. What
the numbers are at scale is docs/RESULTS.md's ``scale-moe-engine`` report, never asserted here."""
import json
import subprocess
import sys

from conftest import ROOT, _env, full_tier


@full_tier(covered_by="tests/test_benchmarks.py::test_scale_bench_smoke_writes_the_documented_report",
           why="scale_bench's launcher, modes and report run in the smoke case; this adds its engine mode")
def test_scale_bench_engine_mode_measures_the_forward_and_its_peak(tmp_path):
    report = tmp_path / "engine.json"
    proc = subprocess.run([sys.executable, "benchmarks/scale_bench.py", "--cases", "tiny-moe-tp2-sp-ep2-64-bf16",
                           "--modes", "engine", "--forward-only", "--no-components", "--rounds", "1", "--repeats", "1",
                           "--json", str(report)], env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    data = json.loads(report.read_text())
    assert data["settings"]["forward_only"] is True
    (case,) = data["cases"]
    assert "failed" not in case and set(case["modes"]) == {"vanilla", "engine"}
    for mode, m in case["modes"].items():
        assert m["forward_s"] > 0 and m["forward_peak_mb"] > 0, mode
        assert m["step_s"] is None and m["peak_mb"] is None and m["step_bytes"] is None, mode
    ratios = case["ratios"]["engine"]
    assert ratios["forward_peak_mb"] > 0 and ratios["forward_s"] > 0 and ratios["step_s"] is None
