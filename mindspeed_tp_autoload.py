"""Interpreter-start hook of mindspeed-tp, imported by the ``mindspeed_tp-autoload.pth`` file the
package installs into site-packages (a top-level module so that importing it loads neither torch
nor the package). It only registers post-import hooks, so

- ``MINDSPEED_TP=1`` enables the patches as soon as ``megatron.core`` has been imported, in any
  script (verl workers, pretrain_gpt.py, ...) without code changes;
- once a training script imports ``megatron.training.arguments``, the package is imported, and its
  integration registry wraps ``parse_args`` (``--true-on-policy``, ``--true-on-policy-profile``);
- ``MINDSPEED_TP_VLLM_AMX=off`` hides Intel AMX from torch's capability report (and caps oneDNN at
  AVX-512-BF16) in every process, vLLM's engine processes included, before any kernel is chosen:
  the vllm-cpu profiles model vLLM's AVX-512-BF16 kernels, not its AMX ones.

``when_imported`` is also the trigger the package's integration registry uses.
"""
import importlib.abc
import importlib.util
import os
import sys
import types

_TRAINING_ARGS = "megatron.training.arguments"
_CORE = "megatron.core"


# vLLM's CPU dispatch (GEMM, attention, fused MoE, MLA) asks torch.cpu whether the host has AMX tiles;
# oneDNN (torch's and vLLM's own copy) reads its ISA ceiling from the environment at first use.
AMX_SWITCH = "MINDSPEED_TP_VLLM_AMX"
ONEDNN_CEILING = ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
AMX_CAPABILITIES = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def amx_off_requested(env=None) -> bool:
    """Whether ``env`` (this process's environment by default) sets ``MINDSPEED_TP_VLLM_AMX=off``."""
    return (os.environ if env is None else env).get(AMX_SWITCH, "").strip().lower() == "off"


def hide_amx(cpu_module) -> None:
    """``torch.cpu.get_capabilities`` (behind every ``torch.cpu._is_amx_*_supported``) reports no AMX;
    the hardware's own report stays readable as its ``hardware`` attribute."""
    if getattr(cpu_module.get_capabilities, "hardware", None) is not None:
        return
    hardware = cpu_module.get_capabilities()
    hidden = types.MappingProxyType({k: (False if k in AMX_CAPABILITIES else v) for k, v in hardware.items()})

    def get_capabilities():
        return hidden

    get_capabilities.hardware = hardware
    get_capabilities.__doc__ = cpu_module.get_capabilities.__doc__
    cpu_module.get_capabilities = get_capabilities


def env_requested() -> bool:
    return os.environ.get("MINDSPEED_TP", "").strip().lower() in ("1", "true", "yes", "on")


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs a callback right after a named module finishes executing."""

    def __init__(self):
        self.hooks = {}
        self._busy = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.hooks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callbacks = spec.loader, self.hooks.pop(fullname)
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            for cb in callbacks:
                cb(module)

        loader.exec_module = exec_module
        return spec


_finder = None


def when_imported(name, callback) -> None:
    """Call ``callback(module)`` now if ``name`` is imported, else right after it is."""
    global _finder
    if name in sys.modules:
        callback(sys.modules[name])
        return
    if _finder is None:
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)
    _finder.hooks.setdefault(name, []).append(callback)


def _enable_from_env(_module) -> None:
    import mindspeed_tp

    mindspeed_tp.enable(os.environ.get("MINDSPEED_TP_PROFILE") or None)


def _load_package(_module) -> None:
    # Importing the package installs its integration triggers; the module is already imported,
    # so the trigger applies the parse_args wrap at once.
    import mindspeed_tp  # noqa: F401


def install() -> None:
    if amx_off_requested():
        os.environ.setdefault(*ONEDNN_CEILING)  # before any oneDNN in this process reads it
        when_imported("torch.cpu", hide_amx)
    when_imported(_TRAINING_ARGS, _load_package)
    if env_requested():
        when_imported(_CORE, _enable_from_env)


install()
