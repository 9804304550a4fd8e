"""Stand-in for torch_npu: registers ``torch.npu`` whose is_available() returns AVAILABLE."""
import torch

AVAILABLE = False


class _NpuModule:
    @staticmethod
    def is_available():
        return AVAILABLE

    @staticmethod
    def get_device_name(*args):
        return "Ascend910B (stand-in)"


npu = _NpuModule()
torch.npu = npu
