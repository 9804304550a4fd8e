"""The megatron-core patch set. ``registry()`` builds it once; enable()/disable() apply/revert it."""
from typing import Optional

from ..patching import PatchRegistry

_registry: Optional[PatchRegistry] = None


def registry() -> PatchRegistry:
    global _registry
    if _registry is None:
        from . import attention, models, moe, norms, residual, tensor_parallel

        reg = PatchRegistry("mindspeed-tp")
        for module in (tensor_parallel, attention, norms, models, moe, residual):
            module.register(reg)
        _registry = reg
    return _registry
