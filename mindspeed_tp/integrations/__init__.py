"""Integrations with the frameworks around megatron-core: Megatron-LM's training arguments
(``megatron_training``), MindSpeed (``mindspeed``), verl (``verl``) and vLLM's sampling parameters
(``vllm_sampling``).

Each one contributes its changes to those packages' namespaces to one registry of import-time
patches (``on_import``: applied when the package's module is imported, never importing it
ourselves), listed by ``mindspeed-tp patches``, reverted by ``disable()`` and re-armed by
``enable()``. ``install`` registers the post-import triggers (once per process).
"""
from typing import Callable, Optional

from .. import switch
from ..patching import PatchRegistry
from . import megatron_training, mindspeed, verl, vllm_sampling

_registry: Optional[PatchRegistry] = None
_installed = False


def registry() -> PatchRegistry:
    global _registry
    if _registry is None:
        reg = PatchRegistry("mindspeed-tp integrations")
        for module in (megatron_training, mindspeed, verl, vllm_sampling):
            module.register(reg)
        _registry = reg
    return _registry


def _on_import(module) -> None:
    reg = registry()
    if reg.armed:
        reg.apply_imported(module.__name__)
    after = mindspeed.AFTER_IMPORT.get(module.__name__)
    if after is not None:
        after(module)


def install(when_imported: Callable[[str, Callable], None]) -> None:
    """Post-import triggers for every integration module (``mindspeed_tp_autoload.when_imported``)."""
    global _installed
    if _installed:
        return
    _installed = True
    reg = registry()
    switch.attach(reg)
    switch.add_enable_check(mindspeed.check_loaded_mindspeed)
    for name in sorted(set(reg.import_triggers()) | set(mindspeed.AFTER_IMPORT)):
        when_imported(name, _on_import)
