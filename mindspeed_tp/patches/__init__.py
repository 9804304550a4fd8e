"""The megatron-core adapters: each patch checks megatron's arguments and calls the active numerics
strategy (``numerics.ACTIVE``, set by enable()). ``registry()`` builds the patch set once: every
adapter module's targets, then each strategy's own entries; enable()/disable() apply and revert it.
``context_parallel`` (registered by ``attention``) is the attention's context-parallel path."""
from typing import Optional

from .. import numerics
from ..patching import PatchRegistry
from . import attention, mlp, models, moe, norms, residual, tensor_parallel

_registry: Optional[PatchRegistry] = None


def build_registry() -> PatchRegistry:
    """The patch set: every adapter module's targets, then each registered mode's own entries (its
    package's ``register_patches``), in registry order."""
    reg = PatchRegistry("mindspeed-tp")
    for module in (tensor_parallel, attention, norms, mlp, models, moe, residual):
        module.register(reg)
    for package in numerics.strategy_packages():
        register = getattr(package, "register_patches", None)  # entries a mode defines itself
        if register is not None:
            register(reg)
    return reg


def registry() -> PatchRegistry:
    """The one patch set enable() applies (built once)."""
    global _registry
    if _registry is None:
        _registry = build_registry()
    return _registry
