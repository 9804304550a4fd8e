#!/usr/bin/env bash
# The GPU check (issues 17, 44), end to end on one CUDA GPU, meant to finish in 8 minutes:
#   1. the triton kernel invariance tests, compiled on the GPU (tests/test_triton_backend.py with
#      MINDSPEED_TP_TRITON_DEVICE=cuda);
#   2. `mindspeed-tp check --device cuda` (all ranks on the one GPU, collectives staged through host
#      memory), bitwise against one device with vanilla megatron-core alongside: tiny-dense and tiny-moe,
#      bf16 and fp32, across layouts;
#   3. the rollout match against the reference engine on the GPU (`check --rollout 6`) at T=0.7 and
#      T=1.0, dense and MoE;
#   4. `train-check --device cuda` (2 steps) and `rl-check --device cuda` (3 iterations);
#   5. with BENCH=1 also benchmarks/gpu_bench.py (GEMM TFLOP/s against cuBLAS, model forward and step
#      against vanilla at sequence 4096, TP=1 with each mode's top kernels (--profile) and TP=2): issues
#      46 and 59's numbers, not part of the 8 minutes.
# Results: JSON (and each step's log) in OUT_DIR; summary.json and the table printed at the end give
# each step's exit code, time and verdict.
#
#   bash scripts/device_check.sh [OUT_DIR]              # default ./device-out
#   DRY_RUN=1 bash scripts/device_check.sh [OUT_DIR]    # CPU: the same steps on tiny sizes (interpreter,
#                                                       # --device cpu): checks the script, not the GPU
#
# No package index on the GPU machine: what is missing (megatron-core, pyyaml, safetensors, numpy,
# packaging, pytest) is installed from wheels in scripts/.whl/ (git-ignored) into .gpu-site/ (on
# PYTHONPATH; the machine's own torch and triton are used). Fill it where an index is reachable (about 21 MB;
# megatron-core without its dependencies, which would pull a CUDA torch):
#   P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d scripts/.whl"
#   pip download $P --no-deps megatron-core==0.16.1 && pip download $P pyyaml safetensors numpy packaging pytest
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
out="$(mkdir -p "${1:-device-out}" && cd "${1:-device-out}" && pwd)"
dry="${DRY_RUN:-0}"
wheels="$here/.whl"
cd "$root"
: > "$out/steps.jsonl"

# ---- Python: the machine's interpreter; what it lacks goes from the wheels into .gpu-site (on
# PYTHONPATH, so the torchrun workers see it too). No venv: the machine may lack ensurepip.
py="${PYTHON:-python3}"
site="$root/.gpu-site"
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
missing=() mcore=()
for pair in megatron.core:megatron-core yaml:pyyaml safetensors:safetensors numpy:numpy packaging:packaging \
            pytest:pytest triton:triton; do
  "$py" -c "import ${pair%%:*}" 2>/dev/null && continue
  if [ "${pair##*:}" = megatron-core ]; then mcore=(megatron-core); else missing+=("${pair##*:}"); fi
done
if ((${#missing[@]} + ${#mcore[@]})); then
  if [ ! -d "$wheels" ]; then
    echo "device_check: missing ${missing[*]} ${mcore[*]} and no wheel folder $wheels (see the pip download lines" \
         "at the top of this script)" >&2
    exit 2
  fi
  echo "device_check: installing ${missing[*]} ${mcore[*]} from $wheels into $site"
  # megatron-core without its dependencies (it names torch; the machine's is used).
  { if ((${#missing[@]})); then "$py" -m pip install --no-index --find-links "$wheels" --target "$site" "${missing[@]}"; fi &&
    if ((${#mcore[@]})); then "$py" -m pip install --no-index --find-links "$wheels" --target "$site" --no-deps megatron-core; fi
  } > "$out/install.log" 2>&1 || { echo "device_check: install from $wheels failed (see $out/install.log)" >&2; exit 2; }
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

"$py" - "$out/env.json" <<'EOF'
import json, platform, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
for name in ("triton", "megatron.core", "numpy"):
    try:
        mod = __import__(name, fromlist=["x"])
        info[name] = getattr(mod, "__version__", "?")
    except ImportError as exc:
        info[name] = f"missing: {exc}"
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
EOF

# ---- Steps: each under a time limit, its log and exit code recorded.
step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit=$(($2 * limit_scale)); shift 2
  local t0=$SECONDS rc
  timeout --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "exit_code": %d, "seconds": %d, "limit_s": %d}\n' "$name" "$rc" $((SECONDS - t0)) "$limit" \
    >> "$out/steps.jsonl"
  printf '%-24s exit %3d  %4ds (limit %ds)\n' "$name" "$rc" $((SECONDS - t0)) "$limit"
}

limit_scale=1
bench="${BENCH:-0}"
if [ "$dry" = 1 ]; then
  limit_scale="${DRY_LIMIT_SCALE:-6}"  # 2 shared CPU cores, Triton's interpreter
  device=cpu; kernel_env=(env -u MINDSPEED_TP_TRITON_DEVICE)
  kernel_select=(-k "row_invariant_in_m or tree_of_rank or chunked_prefill or paged_decode or prepare")
  dense_bf16=tp2; dense_fp32=tp2; moe_bf16=tp2-sp-ep2; moe_fp32=tp1-ep2
  gemm_env=(env TRITON_INTERPRET=1); gemm_args=(--device cpu --tokens 64 --model tiny-dense --warmup 0 --iters 1)
  model_args=(--device cpu --model tiny-dense --seq-length 128 --repeats 1)
else
  device=cuda; kernel_env=(env MINDSPEED_TP_TRITON_DEVICE=cuda)
  kernel_select=()
  dense_bf16=tp2,tp2-sp,tp4-sp-pp2; dense_fp32=tp2-sp,tp2-pp2; moe_bf16=tp2-sp-ep2,tp1-ep2; moe_fp32=tp2-sp-ep2
  gemm_env=(env); gemm_args=(--device cuda)
  model_args=(--device cuda --model bench-dense-2048 --seq-length 4096 --repeats 3)
fi
check() {  # check NAME LIMIT ARGS...: mindspeed-tp check on the device, its JSON report in OUT_DIR
  local name="$1" limit="$2"; shift 2
  step "$name" "$limit" "$py" -m mindspeed_tp.cli check --device "$device" --timeout 90 --json "$out/$name.json" "$@"
}

step kernel-tests 120 "${kernel_env[@]}" "$py" -m pytest tests/test_triton_backend.py -q -p no:cacheprovider \
  "${kernel_select[@]}" --junitxml "$out/kernel-tests.xml"
check check-dense-bf16 90 --model tiny-dense --dtype bf16 --layouts "$dense_bf16" --compare-vanilla
check check-dense-fp32 60 --model tiny-dense --dtype fp32 --layouts "$dense_fp32" --compare-vanilla
check check-moe-bf16 60 --model tiny-moe --dtype bf16 --layouts "$moe_bf16" --compare-vanilla
check check-moe-fp32 60 --model tiny-moe --dtype fp32 --layouts "$moe_fp32" --compare-vanilla
check rollout-dense-t0.7 45 --model tiny-dense --dtype bf16 --layouts tp2-sp --rollout 6 --temperature 0.7
check rollout-dense-t1.0 45 --model tiny-dense --dtype fp32 --layouts tp2-sp --rollout 6 --temperature 1.0
check rollout-moe-t0.7 45 --model tiny-moe --dtype bf16 --layouts tp2-sp-ep2 --rollout 6 --temperature 0.7
check rollout-moe-t1.0 45 --model tiny-moe --dtype bf16 --layouts tp2-sp-ep2 --rollout 6 --temperature 1.0
step train-check 75 "$py" -m mindspeed_tp.cli train-check --device "$device" --model tiny-dense --dtype bf16 \
  --layouts tp2-sp --steps 2 --timeout 60 --json "$out/train-check.json"
step rl-check 90 "$py" -m mindspeed_tp.cli rl-check --device "$device" --model tiny-dense --layout tp2-sp \
  --iterations 3 --timeout 60 --json "$out/rl-check.json"
if [ "$bench" = 1 ]; then
  step bench-gemm 45 "${gemm_env[@]}" "$py" benchmarks/gpu_bench.py gemm "${gemm_args[@]}" --json "$out/bench-gemm.json"
  step bench-model-tp1 60 "$py" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_bench.py \
    model --layout tp1 "${model_args[@]}" --profile --json "$out/bench-model-tp1.json"
  step bench-model-tp2 75 "$py" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu_bench.py \
    model --layout tp2 "${model_args[@]}" --json "$out/bench-model-tp2.json"
fi

# ---- summary.json: every step's exit code and the numbers the issue asks for.
"$py" - "$out" "$dry" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

out, dry = sys.argv[1], sys.argv[2] == "1"


def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None


steps = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]
summary = {"dry_run_on_cpu": dry, "env": load("env.json"), "steps": steps,
           "all_steps_passed": all(s["exit_code"] == 0 for s in steps)}
xml = os.path.join(out, "kernel-tests.xml")
if os.path.exists(xml):
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    cases = suite.findall("testcase")
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None
              or c.find("error") is not None]
    summary["kernel_tests"] = {"tests": len(cases), "failed": failed}
    json.dump(summary["kernel_tests"], open(os.path.join(out, "kernel-tests.json"), "w"), indent=2)
verdicts = {}
for s in steps:
    report = load(s["step"] + ".json")
    if not report:
        continue
    if "results" in report and "arms" not in report and s["step"].startswith(("check", "rollout")):
        rows = [{"layout": r["layout"]["name"], "vanilla": r["vanilla"],
                 "bitwise_equal_fraction": r.get("bitwise_equal_fraction"),
                 "max_abs_logdiff": r.get("max_abs_logdiff"), "cannot_run": r.get("unsupported")}
                for r in report["results"]]
        summary[s["step"]] = {"all_bitwise_equal": report.get("all_bitwise_equal"), "rows": rows}
        ours = [r for r in rows if not r["vanilla"]]
        vanilla = [r for r in rows if r["vanilla"]]
        verdicts[s["step"]] = (f"{sum(r['bitwise_equal_fraction'] == 1.0 for r in ours)}/{len(ours)} layouts 100 %"
                               + (f"; vanilla rows {len(vanilla)} ({sum(bool(r['cannot_run']) for r in vanilla)} "
                                  f"cannot run)" if vanilla else ""))
    else:  # train-check, rl-check
        summary[s["step"]] = {"all_bitwise_equal": report.get("all_bitwise_equal")}
        verdicts[s["step"]] = f"all_bitwise_equal={report.get('all_bitwise_equal')}"
if "kernel_tests" in summary:
    k = summary["kernel_tests"]
    verdicts["kernel-tests"] = f"{k['tests'] - len(k['failed'])}/{k['tests']} passed"
gemm = load("bench-gemm.json")
if gemm:
    summary["gemm_invariant_over_cublas"] = {f"{r['gemm']}@M={r['M']}": round(r["invariant_over_cublas"], 3)
                                             for r in gemm["rows"]}
for tp in ("tp1", "tp2"):
    model = load(f"bench-model-{tp}.json")
    if model:
        summary[f"model_{tp}_consistent_over_vanilla"] = {k: round(v, 3) for k, v in model["ratios"].items()}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(f"{'step':<22} {'exit':>4} {'seconds':>7}  verdict")
for s in steps:
    print(f"{s['step']:<22} {s['exit_code']:>4} {s['seconds']:>7}  {verdicts.get(s['step'], '')}")
print(f"{'total':<22} {'':>4} {sum(s['seconds'] for s in steps):>7}")
for key in ("gemm_invariant_over_cublas", "model_tp1_consistent_over_vanilla", "model_tp2_consistent_over_vanilla"):
    if key in summary:
        print(key, json.dumps(summary[key]))
print("device_check:", "all steps passed" if summary["all_steps_passed"] else "SOME STEPS FAILED", "->", out)
sys.exit(0 if summary["all_steps_passed"] else 1)
EOF
