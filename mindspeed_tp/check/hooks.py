"""Extension points of the checker run: plugins observe or alter a run at fixed points.

Nothing is registered in a normal run, so every point is a no-op. A plugin is a module named in
``MINDSPEED_TP_CHECK_PLUGINS`` (comma-separated, importable on every rank; read once when a
checker rank starts) whose ``register(hooks)`` calls ``hooks.add(point, fn)``. Points:

- ``point``: ``fn(name, rank)`` at ``start`` (process group up) and ``forward`` (before each layout);
- ``before_forward``: ``fn(model, layout, tp_rank) -> [handles]`` (removed after the forward);
- ``logits``: ``fn(logits, layout, tp_rank) -> logits``;
- ``step_logprobs`` (rl-check): ``fn(logprobs, mask) -> logprobs``, the training step's gathered logprobs.

The checker's own tests inject faults this way (tests/support/fault_injection.py).
"""
import importlib
import os
import sys
from typing import Callable, Dict, List

PLUGINS_ENV = "MINDSPEED_TP_CHECK_PLUGINS"
POINTS = ("point", "before_forward", "logits", "step_logprobs")
_hooks: Dict[str, List[Callable]] = {p: [] for p in POINTS}
_loaded = False


def add(point: str, fn: Callable) -> None:
    if point not in _hooks:
        raise ValueError(f"unknown checker hook point {point!r}; points: {POINTS}")
    _hooks[point].append(fn)


def load_plugins() -> None:
    """Import the plugins named in MINDSPEED_TP_CHECK_PLUGINS (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(name).register(sys.modules[__name__])


def at_point(name: str, rank: int) -> None:
    for fn in _hooks["point"]:
        fn(name, rank)


def before_forward(model, layout, tp_rank: int) -> list:
    return [h for fn in _hooks["before_forward"] for h in fn(model, layout, tp_rank)]


def on_logits(logits, layout, tp_rank: int):
    for fn in _hooks["logits"]:
        logits = fn(logits, layout, tp_rank)
    return logits


def on_step_logprobs(logprobs, mask):
    for fn in _hooks["step_logprobs"]:
        logprobs = fn(logprobs, mask)
    return logprobs
