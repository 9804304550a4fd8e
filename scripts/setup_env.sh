#!/usr/bin/env bash
# Create (or reuse) .venv-mc<VERSION>: torch, megatron-core <VERSION>, mindspeed-tp + test deps (and, on
# >= 0.16, the real verl and mbridge).
# TORCH_SPEC pins torch for this machine (a local CPU wheel); set it to what your platform needs.
set -euo pipefail
version="${1:?usage: scripts/setup_env.sh MEGATRON_CORE_VERSION}"
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv-mc$version"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.mindspeed-tp-stamp"
src_hash="$(cd "$root" && cat setup.py mindspeed_tp-autoload.pth mindspeed_tp_autoload.py $(find mindspeed_tp -type f \( -name '*.py' -o -name '*.yaml' \) | sort) | sha256sum | cut -c1-16)"
verl_spec="verl==0.9.1"
mbridge_spec="mbridge==0.15.1"
want="$torch_spec megatron-core==$version $verl_spec $mbridge_spec $src_hash"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip -q --disable-pip-version-check "$@"; }
pip install "$torch_spec"
constraints="$venv/constraints.txt"  # every later install keeps this torch
echo "$torch_spec" > "$constraints"
# megatron-core 0.12.x declares dozens of training-only dependencies a CPU run never imports;
# 0.16.x needs only numpy and packaging. Install without them, then what both really use.
# >= 0.17 declares Requires-Python >= 3.12 but ships a cp311 wheel (a Python 3.12 user needs no flag);
# >= 0.18 imports triton unconditionally (transformer/moe/ops/paged_stash.py) without declaring it:
# triton's own dependencies are GPU tooling a CPU run never loads, so install it without them.
line="$(echo "$version" | cut -d. -f2)"
mc_flags=()
if [ "$line" -ge 17 ]; then mc_flags+=(--ignore-requires-python); fi
pip install --no-deps "${mc_flags[@]}" "megatron-core==$version"
pip install numpy packaging
if [ "$line" -ge 18 ]; then pip install --no-deps triton; fi
# A regular (not editable) install: it ships the .pth autoload hook (MINDSPEED_TP=1, training flags).
pip install --force-reinstall --no-deps "$root" && pip install -c "$constraints" "$root[test]"
# The real verl and mbridge (>= 0.16: what verl 0.9 runs on), without their declared dependencies
# (ray[default], wandb, vllm tooling, a transformers cap, ...: the trainer and the Ray cluster's);
# then only what the import paths of verl's Megatron engine and mbridge need. torch stays pinned.
if [ "$line" -ge 16 ]; then
  pip install --no-deps "$verl_spec" "$mbridge_spec"
  pip install -c "$constraints" ray "tensordict>=0.8,<=0.10.0,!=0.9.0" omegaconf codetiming peft datasets einops
fi
echo "$want" > "$stamp"
