"""The megatron-core numerics patch set. ``registry()`` builds it once; enable()/disable() apply
and revert it. Each module registers its targets with their reasons."""
from typing import Optional

from ..modes import rollout_layout
from ..modes.bitwise_training import patches as bitwise_training
from ..patching import PatchRegistry
from . import attention, models, moe, norms, residual, tensor_parallel

_registry: Optional[PatchRegistry] = None


def registry() -> PatchRegistry:
    global _registry
    if _registry is None:
        reg = PatchRegistry("mindspeed-tp")
        for module in (tensor_parallel, attention, norms, models, moe, rollout_layout, residual, bitwise_training):
            module.register(reg)
        _registry = reg
    return _registry
