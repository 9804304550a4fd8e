"""A registry of patches: each replaced symbol with the reason, applied once, reversible.

Targets are written ``"package.module:Name"`` or ``"package.module:Class.attr"``. A module-level
function is also rebound in every loaded module that imported it by name (``from x import f``
copies the reference), the way MindSpeed's patch manager does; a class attribute is replaced on
the class, which every importer shares.

Whatever holds a target when apply() runs is what a patch replaces, so enabling after
``mindspeed.megatron_adaptor`` replaces MindSpeed's replacement (and its rebinding in every module)
and revert() restores MindSpeed's. A patch someone rebinds after apply() (MindSpeed imported later,
or its ``repatch()``) is *displaced*: ``displaced()`` lists it and the next apply() takes the
target back -- on the same owner, or on the class that now stands under the target's name.

mindspeed-tp's own modules are never rebound (they call their own functions by name), and a
patch never records a replacement of ours as "the original". Two more kinds of entry:
- ``on_import=True``: the target's module is never imported by apply(); the patch is applied
  when that module has been imported (``apply_imported``, called from a post-import hook), for
  integrations with packages that may be absent (verl, MindSpeed, Megatron-LM's training args);
- ``Hook``: something installed with a handle and removed again (a torch global hook).
"""
from __future__ import annotations

import functools
import importlib
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

from .errors import PatchImportError, PatchTargetError

_MISSING = object()


@dataclass
class Patch:
    target: str
    # Either the replacement itself, or (with wraps=True) a factory original -> replacement.
    replacement: Callable[..., Any]
    reason: str
    wraps: bool = False
    # Optional patches are skipped when the target is absent (version-specific targets).
    optional: bool = False
    # Applied only once the target's module is imported by someone else (never imported here).
    on_import: bool = False
    # Also rebind the name in every module that imported the original by name (False: only here).
    everywhere: bool = True
    # Define a name the target module reads but does not define (skipped when it is defined).
    define_if_absent: bool = False
    # Filled in while applied:
    _owner: Any = field(default=None, repr=False)
    _attr: str = field(default="", repr=False)
    _original: Any = field(default=_MISSING, repr=False)
    _owned: bool = field(default=True, repr=False)  # attr defined on the owner itself (not inherited)
    _new: Any = field(default=None, repr=False)

    @property
    def applied(self) -> bool:
        return self._original is not _MISSING


def resolve(target: str, attr_may_be_absent: bool = False) -> Tuple[Any, str]:
    """Return (owner, attribute) for a target string; raise PatchTargetError if absent."""
    module_name, _, qualname = target.partition(":")
    if not qualname:
        raise ValueError(f"patch target {target!r} must look like 'module:Name'")
    try:
        owner = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if isinstance(exc, ModuleNotFoundError) and missing and (
            module_name == missing or module_name.startswith(missing + ".")
        ):
            raise PatchTargetError(
                f"patch target {target!r}: module {module_name!r} does not exist in the installed version"
            ) from exc
        # The module is there, but something it imports is not (megatron-core >= 0.18 imports
        # triton without declaring it): name that import, not the target.
        raise PatchImportError(
            f"patch target {target!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc} "
            f"(install the missing package{f' {missing!r}' if missing else ''}, e.g. `pip install --no-deps "
            f"{missing}`; the target itself is not at fault)"
        ) from exc
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, _MISSING)
        if owner is _MISSING:
            raise PatchTargetError(f"patch target {target!r}: {part!r} not found in the installed version")
    if not attr_may_be_absent and parts[-1] not in vars(owner) and getattr(owner, parts[-1], _MISSING) is _MISSING:
        raise PatchTargetError(f"patch target {target!r}: {parts[-1]!r} not found in the installed version")
    return owner, parts[-1]


@dataclass
class Hook:
    """An entry that is installed (returning a handle) and removed, not a rebinding."""

    target: str  # what it hooks into, for the listing
    install: Callable[[], Any]
    remove: Callable[[Any], None]
    reason: str
    _handle: Any = field(default=_MISSING, repr=False)

    @property
    def applied(self) -> bool:
        return self._handle is not _MISSING


def _is_ours(module_name: str) -> bool:
    return module_name == "mindspeed_tp" or module_name.startswith(("mindspeed_tp.", "mindspeed_tp_autoload"))


def _swap_in_modules(swaps: Dict[int, Tuple[Any, Any, "Patch"]]) -> None:
    """In every loaded module but mindspeed-tp's own, rebind each name bound to ``old`` to ``new``
    (swaps: id(old) -> (old, new, patch)); the patch target itself is left to the caller."""
    if not swaps:
        return
    for name, module in list(sys.modules.items()):
        if _is_ours(name):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            swap = swaps.get(id(value))
            if swap is not None and value is swap[0] and not (module is swap[2]._owner and name == swap[2]._attr):
                namespace[name] = swap[1]



def _present_as(replacement, original) -> None:
    """A wrapping replacement shows its original's name, docstring and signature (``__wrapped__``):
    code that inspects a patched function (which arguments ``GPTModel.__init__`` takes, say) sees
    the original's, as before the patch."""
    if isinstance(replacement, types.FunctionType) and callable(original) and not hasattr(replacement, "__wrapped__"):
        functools.update_wrapper(replacement, original)

class PatchRegistry:
    def __init__(self, name: str):
        self.name = name
        self.patches: List[Patch] = []
        self.hooks: List[Hook] = []
        # on_import patches wait for their module while armed; revert() disarms, apply() re-arms.
        self.armed = True
        self._lock = threading.RLock()

    def register(self, target: str, reason: str, wraps: bool = False, optional: bool = False):
        """Decorator: register the decorated function (or factory, with wraps=True) for target."""

        def deco(fn):
            self.add(Patch(target=target, replacement=fn, reason=reason, wraps=wraps, optional=optional))
            return fn

        return deco

    def add(self, patch: Patch) -> None:
        if any(p.target == patch.target for p in self.patches):
            raise ValueError(f"{self.name}: target {patch.target!r} registered twice")
        self.patches.append(patch)

    def add_hook(self, hook: Hook) -> None:
        self.hooks.append(hook)

    def entries(self) -> list:
        return [*self.patches, *self.hooks]

    @property
    def applied(self) -> bool:
        return any(p.applied for p in self.entries())

    def _replacements(self) -> set:
        return {id(p._new) for p in self.patches if p.applied}

    def displaced(self) -> List[Patch]:
        """Applied patches whose target no longer resolves to our replacement."""
        out = []
        for p in self.patches:
            if not p.applied:
                continue
            try:
                owner, attr = resolve(p.target)
            except PatchTargetError:
                out.append(p)
                continue
            if owner is not p._owner or vars(owner).get(attr, getattr(owner, attr, None)) is not p._new:
                out.append(p)
        return out

    def _take_back(self, swaps: Dict[int, Tuple[Any, Any, "Patch"]]) -> None:
        """Rebind displaced patches (see the module docstring)."""
        for p in self.displaced():
            owner, attr = resolve(p.target)
            if owner is p._owner:
                displacer = vars(owner).get(attr, getattr(owner, attr))
                setattr(owner, attr, p._new)
                if isinstance(owner, type(sys)) and p.everywhere:
                    swaps[id(displacer)] = (displacer, p._new, p)
            else:  # a new class under the target's name: restore the old one, patch the new one below
                self._restore(p)

    def apply(self) -> List[Patch]:
        """Apply every patch not yet applied and take back displaced ones; idempotent. Returns
        the patches now active. ``on_import`` patches whose module is not imported yet wait."""
        with self._lock:
            self.armed = True
            swaps: Dict[int, Tuple[Any, Any, Patch]] = {}
            self._take_back(swaps)
            # Resolve everything first, so a missing target leaves nothing half-applied.
            resolved = []
            for p in self.patches:
                if p.applied or (p.on_import and p.target.partition(":")[0] not in sys.modules):
                    continue
                try:
                    owner, attr = resolve(p.target, attr_may_be_absent=p.define_if_absent)
                except PatchImportError:  # a broken install, not an absent version-specific target
                    raise
                except PatchTargetError:
                    if p.optional or p.on_import:
                        continue
                    raise
                if p.define_if_absent and hasattr(owner, attr):
                    continue
                resolved.append((p, owner, attr))
            ours = self._replacements()
            for p, owner, attr in resolved:
                # Resolving imports modules, and a post-import hook may have applied this very
                # registry meanwhile: what stands there now may be our own replacement.
                if p.applied:
                    continue
                original = vars(owner).get(attr, getattr(owner, attr, None))
                current = getattr(owner, attr, None)
                if current is not None and id(current) in ours or id(original) in ours:
                    raise PatchTargetError(f"{self.name}: {p.target} already holds a mindspeed-tp replacement")
                new = p.replacement(current) if p.wraps else p.replacement
                if p.wraps:
                    _present_as(new, current)
                if isinstance(original, staticmethod) and not isinstance(new, staticmethod):
                    new = staticmethod(new)
                p._owner, p._attr, p._original, p._new = owner, attr, original, new
                p._owned = attr in vars(owner)
                setattr(owner, attr, new)
                ours.add(id(new))
                if isinstance(owner, type(sys)) and p.everywhere:
                    swaps[id(current)] = (current, new, p)
            _swap_in_modules(swaps)
            for h in self.hooks:
                if not h.applied:
                    h._handle = h.install()
            return [p for p in self.patches if p.applied]

    def apply_imported(self, module_name: str) -> None:
        """A post-import hook's call: apply the ``on_import`` patches targeting ``module_name``."""
        if any(p.on_import and not p.applied and p.target.partition(":")[0] == module_name for p in self.patches):
            self.apply()

    def import_triggers(self) -> List[str]:
        """Modules whose import must call ``apply_imported`` (the ``on_import`` targets)."""
        return sorted({p.target.partition(":")[0] for p in self.patches if p.on_import})

    def revert(self) -> None:
        """Restore every original, in reverse order of application, also in modules that
        imported a patched function by name after apply()."""
        with self._lock:
            self.armed = False
            for h in reversed(self.hooks):
                if h.applied:
                    h.remove(h._handle)
                    h._handle = _MISSING
            active = [p for p in reversed(self.patches) if p.applied]
            _swap_in_modules({id(p._new): (p._new, p._original, p) for p in active
                              if isinstance(p._owner, type(sys)) and p.everywhere})
            for p in active:
                self._restore(p)

    @staticmethod
    def _restore(p: Patch) -> None:
        """Put the original back on the patch's owner (if ours is still there) and mark it unapplied."""
        if vars(p._owner).get(p._attr, _MISSING) is p._new or getattr(p._owner, p._attr, None) is p._new:
            if p._owned:
                setattr(p._owner, p._attr, p._original)
            else:
                delattr(p._owner, p._attr)  # it was inherited: uncover the base's again
        p._owner, p._attr, p._original, p._new = None, "", _MISSING, None

    def describe(self) -> List[Dict[str, str]]:
        return [{"target": p.target, "reason": p.reason, "applied": str(p.applied),
                 "when": "when imported" if getattr(p, "on_import", False) else ("hook" if isinstance(p, Hook) else "")}
                for p in self.entries()]
