"""The checker's processes import megatron-core with ``torch.compile`` deferred to each function's
first call.

megatron-core decorates its fused functions with ``jit_fuser`` (``torch.compile``) while it is
imported. ``torch.compile`` compiles nothing then (that happens at the first call), but it imports
dynamo and inductor: about 4 s of CPU in every process, nearly half of a checker process's start-up
on CPU, where most of those functions are never called. While ``megatron.core`` executes, the
checker lends it a ``torch.compile`` that returns a wrapper calling the real ``torch.compile`` with
the same arguments on the first call: the same compiled function runs if one runs at all.

Installed by ``mindspeed_tp.check`` (the checker's own processes), never by ``enable()``: a training
process imports megatron-core as it always does.
"""
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys

_MODULE = "megatron.core"


def deferring(real_compile):
    """A ``torch.compile`` stand-in: functions are compiled by ``real_compile`` at their first call,
    with every argument given here; anything else (modules, callables) is compiled at once."""

    def compile_on_first_call(model=None, **kwargs):
        if model is None:  # the @torch.compile(**kwargs) form
            return lambda fn: compile_on_first_call(fn, **kwargs)
        if not inspect.isfunction(model):
            return real_compile(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **call_kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **kwargs)
            return compiled(*args, **call_kwargs)

        return first_call_compiles

    return compile_on_first_call


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` as the path finder does and runs its module code with
    ``torch.compile`` deferred; removes itself once used."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODULE:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_with_compile_deferred(module):
            import torch

            real = torch.compile
            torch.compile = deferring(real)
            try:
                exec_module(module)
            finally:
                torch.compile = real

        spec.loader.exec_module = exec_with_compile_deferred
        return spec


_finder = _MegatronCoreFinder()


def install() -> None:
    """Defer megatron-core's compiles in this process, if megatron-core is not imported yet.

    The finder goes right before the path finder, after any post-import hook (the package's .pth
    autoload, ``MINDSPEED_TP=1``): such a hook wraps this loader, so its callbacks (``enable()``,
    which patches ``torch.compile`` itself) run after the real ``torch.compile`` is back."""
    if _MODULE in sys.modules or _finder in sys.meta_path:
        return
    path_finders = [i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder]
    sys.meta_path.insert(path_finders[0] if path_finders else len(sys.meta_path), _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
