"""The switch: ``enable()`` applies the patch registries under a profile, ``disable()`` reverts them.

Registries: the megatron-core numerics patches (``patches.registry()``, applied by enable()) and
the companions attached here -- the integrations' import-time patches (``integrations``), applied
as their modules are imported, reverted by disable() and re-armed by the next enable().
"""
import threading
from typing import Callable, List, Union

from . import compat, numerics, state
from .contract.profile import Profile, load_profile
from .devices import machine_device_type
from .devices.cpu_shims import GROUPS, enable_groups, install_shims, keep_under, remove_shims
from .kernels import dispatch
from .patches import registry as numerics_registry
from .patching import PatchRegistry

_lock = threading.RLock()
_enabling = False
_companions: List[PatchRegistry] = []
_enable_checks: List[Callable[[], None]] = []
keep_under(numerics_registry)  # CPU shims go under the numerics patches
_installed_shims: List[str] = []  # shim groups enable() installed (not someone before it): disable() removes them


def attach(registry: PatchRegistry) -> None:
    """A registry that enable() re-arms and applies and disable() reverts."""
    if registry not in _companions:
        _companions.append(registry)


def add_enable_check(check: Callable[[], None]) -> None:
    """Run ``check()`` at every enable(), before anything is applied (it raises ConfigError)."""
    if check not in _enable_checks:
        _enable_checks.append(check)


def enable(profile: Union[str, Profile, None] = None) -> Profile:
    """Apply the numerics patches (idempotent) under ``profile`` (name, YAML path or Profile).

    Enabling again with a different profile switches the profile; the patches stay applied once,
    and targets someone rebound since (MindSpeed imported later, its ``repatch()``) are taken back.
    An enable() reached from a post-import hook while enable() runs (applying imports megatron-core,
    whose import hook enables) returns at once: the outer call applies everything, once.
    """
    global _enabling, _installed_shims
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    with _lock:
        if _enabling:
            return prof
        _enabling = True
        try:
            for check in _enable_checks:
                check()
            strategy = numerics.resolve(prof)  # the numerics every adapter calls, from here on
            strategy.check_ready()
            dispatch.prepare(prof, machine_device_type())
            groups = enable_groups()  # megatron-core without TE/apex, gloo; never the CUDA stand-ins
            _installed_shims += [g for g in groups if not GROUPS[g].applied and g not in _installed_shims]
            install_shims(*groups)
            compat.warn_if_untested_line()
            state.set_profile(prof)
            numerics.ACTIVE.set(strategy)
            numerics_registry().apply()
            for registry in _companions:
                registry.apply()
        finally:
            _enabling = False
    return prof


def disable() -> None:
    """Restore every original symbol (vanilla behaviour), numerics and integrations alike; what
    enable() set up goes with it (the shims it installed, the explicit vocab size)."""
    global _installed_shims
    with _lock:
        for registry in reversed(_companions):
            registry.revert()
        numerics_registry().revert()
        numerics.ACTIVE.set(None)
        state.set_profile(None)
        state.set_vocab_size(None)
        dispatch.release()
        dispatch.select("auto")
        remove_shims(*_installed_shims)
        _installed_shims = []


def is_enabled() -> bool:
    return state.enabled()
