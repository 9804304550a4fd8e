#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite on both megatron-core lines.
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
exit $status
