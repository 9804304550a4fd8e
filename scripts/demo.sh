#!/usr/bin/env bash
# Set everything up on a fresh machine and run the main job: the consistency check on the bundled
# demo config (tiny-dense, bf16, 7 layouts), vanilla megatron-core next to mindspeed-tp.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
v="${MEGATRON_CORE_VERSION:-0.16.1}"
bash scripts/setup_env.sh "$v"
exec ".venv-mc$v/bin/mindspeed-tp" check --config demo "$@"
