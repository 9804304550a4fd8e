"""The machine: which accelerator is present, and what megatron-core needs to run on it.

Kernel selection is not here (``kernels/dispatch.py``); this package answers what the device is
(``machine_device_type``), holds the Ascend runtime packages (``npu_runtime``) and, for machines
without an accelerator, the CPU shims that let megatron-core run on CPU with gloo (``cpu_shims``:
not numerics).
"""
import torch


def npu_available() -> bool:
    """An Ascend NPU is usable (torch_npu imported and a device present)."""
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def cuda_available() -> bool:
    return torch.cuda.is_available()


def accelerator_available() -> bool:
    return cuda_available() or npu_available()


def machine_device_type() -> str:
    """Where this process's models run: ``npu``, ``cuda`` or ``cpu``."""
    if npu_available():
        return "npu"
    if cuda_available():
        return "cuda"
    return "cpu"
