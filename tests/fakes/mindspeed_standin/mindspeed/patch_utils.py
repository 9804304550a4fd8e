"""Patch manager with MindSpeed's semantics: ``register_patch(dotted_name, new)`` (a ``new`` whose
name ends in ``wrapper`` or ``decorator`` wraps the current function instead), ``apply_patches()``
sets the new object on the owner and rebinds every loaded module attribute that held the replaced
object (by identity), ``remove_patches()`` puts the first-seen original back where the final
patch is found."""
import importlib
import sys


class _Patch:
    def __init__(self, dotted):
        self.module_name, self.name = dotted.rsplit(".", 1)
        self.new = None
        self.wrappers = []
        self.owner = self.original = self.final = None
        self.applied = False

    def add(self, new):
        if getattr(new, "__name__", "").endswith(("wrapper", "decorator")):
            self.wrappers.append(new)
        else:
            self.new = new
        self.applied = False

    def _owner(self):
        try:
            return importlib.import_module(self.module_name)
        except ModuleNotFoundError:  # a class path: module.Class
            module_name, cls = self.module_name.rsplit(".", 1)
            return getattr(importlib.import_module(module_name), cls)

    def apply(self):
        if self.applied:
            return
        owner = self._owner()
        current = getattr(owner, self.name)
        if self.owner is None:
            self.owner, self.original = owner, current
        final = self.new if self.new is not None else self.original
        for wrap in self.wrappers:
            final = wrap(final)
        setattr(self.owner, self.name, final)
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, self.name, None) is current:
                setattr(module, self.name, final)
        self.final, self.applied = final, True

    def remove(self):
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, self.name, None) is self.final:
                setattr(module, self.name, self.original)
        if getattr(self.owner, self.name, None) is self.final:
            setattr(self.owner, self.name, self.original)
        self.applied = False


class MindSpeedPatchesManager:
    patches_info = {}

    @staticmethod
    def register_patch(orig_func_name, new_func=None, force_patch=False, create_dummy=False):
        MindSpeedPatchesManager.patches_info.setdefault(orig_func_name, _Patch(orig_func_name)).add(new_func)

    @staticmethod
    def apply_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.apply()

    @staticmethod
    def remove_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.remove()
