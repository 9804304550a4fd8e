"""The megatron-core adapters: each patch checks megatron's arguments and calls the active numerics
strategy (``numerics.ACTIVE``, set by enable()). ``registry()`` builds the patch set once: every
adapter module's targets, then each strategy's own entries; enable()/disable() apply and revert it.
``context_parallel`` (registered by ``attention``) is the attention's context-parallel path."""
from typing import Optional

from .. import numerics
from ..patching import PatchRegistry
from . import attention, mlp, models, moe, norms, residual, tensor_parallel

_registry: Optional[PatchRegistry] = None


def registry() -> PatchRegistry:
    global _registry
    if _registry is None:
        reg = PatchRegistry("mindspeed-tp")
        for module in (tensor_parallel, attention, norms, mlp, models, moe, residual):
            module.register(reg)
        for strategy in numerics.strategy_classes():
            if "register_patches" in vars(strategy):  # entries a strategy defines itself, once
                strategy.register_patches(reg)
        _registry = reg
    return _registry
