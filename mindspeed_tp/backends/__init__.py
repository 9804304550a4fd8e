"""Execution backends and which kernel backend runs a call.

- ``torch``: the reference kernels in ``mindspeed_tp/kernels`` (CPU, always tested); on a machine
  without an accelerator, ``cpu_shims`` also makes megatron-core run without CUDA (not numerics).
- ``npu``: the same kernel interface through CANN's batch-invariant ops and the Ascend
  flash-attention kernels (``mindspeed_tp/kernels/npu.py``; packages loaded by ``backends/npu.py``).

The profile's ``backend`` field picks: ``auto`` runs the npu kernels for tensors that live on an
NPU and the torch kernels otherwise; ``torch`` / ``npu`` force one for every call.
"""
import torch

from ..profile import BACKENDS, Profile

# What enable() last selected; "auto" until then (the reference model and the checker call the
# kernels without enable() on CPU).
_selected = "auto"


def accelerator_available() -> bool:
    if torch.cuda.is_available():
        return True
    return npu_available()


def npu_available() -> bool:
    """An Ascend NPU is usable (torch_npu imported and a device present)."""
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def selected_backend() -> str:
    return _selected


def set_backend(name: str) -> None:
    global _selected
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _selected = name


def use_npu(tensor: torch.Tensor) -> bool:
    """Whether a kernel call on ``tensor`` goes to the npu backend."""
    if _selected == "npu":
        return True
    return _selected == "auto" and tensor.device.type == "npu"


def ensure_backend_ready(profile: Profile) -> str:
    """Prepare the backend the profile selects and remember the choice; returns its name.

    ``npu`` (forced, or ``auto`` on a machine with an NPU) loads every Ascend package first, so a
    missing one is a ConfigError naming it here, at enable time, not in the middle of a forward.
    """
    wants_npu = profile.backend == "npu" or (profile.backend == "auto" and npu_available())
    if wants_npu:
        from . import npu

        npu.prepare()
    set_backend(profile.backend)
    if not accelerator_available():
        from .cpu_shims import install_cpu_shims

        install_cpu_shims()
    return "npu" if wants_npu else "torch"
