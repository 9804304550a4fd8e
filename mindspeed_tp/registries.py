"""Every patch set mindspeed-tp registers, named in one list (``REGISTRIES``, in the order
``mindspeed-tp patches`` prints them). Each set is applied by its owner, as its docstring says; this
module only names them:

- the numerics patches (``patches.registry()``): the megatron-core adapters (``patches/``), then each
  numerics mode's own entries (``numerics/<mode>/patches.py``, through ``numerics.MODES`` /
  ``ENGINES``); enable() applies them, disable() reverts them;
- the integrations (``integrations.registry()``: Megatron-LM's training arguments, MindSpeed, verl):
  applied when their package's module is imported, while enabled;
- the shim groups (``devices/cpu_shims.GROUPS``): enable() installs ``enable_groups()`` (no_te_apex,
  gloo) where their condition holds, never cuda_standins, which CPU-only megatron processes (the
  checkers, tests, benchmarks) install themselves;
- checker-only: host staging (``check/host_staging.py``), installed by the checker when its ranks
  share a GPU. (The checker's deferred ``torch.compile``, ``check/deferred_compile.py``, is an import
  hook around megatron-core's import, not a patch set.)

It sits above ``check`` (it names the checker's set) and below ``cli``; nothing else imports it, so
the layers below keep applying their own sets (``switch`` the numerics set and its companions).
"""
from typing import Callable, List, NamedTuple

from . import integrations, patches
from .check import host_staging
from .devices.cpu_shims import GROUPS as SHIM_GROUPS
from .patching import PatchRegistry


class Registered(NamedTuple):
    title: str  # the heading ``mindspeed-tp patches`` prints: what the set is and who applies it
    registry: Callable[[], PatchRegistry]


def _shim_group(name: str) -> Registered:
    group = SHIM_GROUPS[name]
    return Registered(f"{group.name} (where its condition holds: devices/cpu_shims.py)", lambda: group)


REGISTRIES: List[Registered] = [
    Registered("numerics patches (enable)", patches.registry),
    Registered("integrations (applied when the module is imported)", integrations.registry),
    *(_shim_group(name) for name in SHIM_GROUPS),
    Registered("host staging (the checker, when its ranks share a GPU: check/host_staging.py)",
               host_staging.staging_registry),
]
