#!/usr/bin/env bash
# Create (or reuse) .venv-mc<VERSION>: torch, megatron-core <VERSION>, mindspeed-tp (editable) + test deps.
# TORCH_SPEC pins torch for this machine (a local CPU wheel); set it to what your platform needs.
set -euo pipefail
version="${1:?usage: scripts/setup_env.sh MEGATRON_CORE_VERSION}"
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv-mc$version"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.mindspeed-tp-stamp"
src_hash="$(cd "$root" && cat setup.py mindspeed_tp-autoload.pth mindspeed_tp_autoload.py $(find mindspeed_tp -type f \( -name '*.py' -o -name '*.yaml' \) | sort) | sha256sum | cut -c1-16)"
want="$torch_spec megatron-core==$version $src_hash"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip -q --disable-pip-version-check "$@"; }
pip install "$torch_spec"
# megatron-core 0.12.x declares dozens of training-only dependencies a CPU run never imports;
# 0.16.x needs only numpy and packaging. Install without them, then what both really use.
pip install --no-deps "megatron-core==$version"
pip install numpy packaging
# A regular (not editable) install: it ships the .pth autoload hook (MINDSPEED_TP=1, training flags).
pip install --force-reinstall --no-deps "$root" && pip install "$root[test]"
echo "$want" > "$stamp"
