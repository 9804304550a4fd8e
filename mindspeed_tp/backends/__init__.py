"""Execution backends. Today: the CPU (torch reference kernels, gloo), with the shims megatron-core
needs to run without CUDA kept in ``cpu_shims`` -- apart from the numerics patches."""
import torch

from ..profile import Profile


def accelerator_available() -> bool:
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def ensure_backend_ready(profile: Profile) -> str:
    """Prepare the backend the profile selects; returns its name."""
    if not accelerator_available():
        from .cpu_shims import install_cpu_shims

        install_cpu_shims()
        return "torch-cpu"
    return "torch"
