"""When a cache derived from weights is stale: the rollout layout's re-laid row-parallel weights
(``numerics/rollout_layout/relayout.py``) and the vLLM engine's prepacked GEMM and expert weights
(``integrations/vllm``).

An entry's key holds a process-wide generation, the weight's in-place version counter and its
storage, so an in-place edit (``param.copy_``) or a new ``param.data`` tensor forces a recompute.
Writes that bump no version counter -- through ``param.data`` (megatron's optimizer copying main
params back, an EMA, an actor/reference swap), or into existing tensors by a checkpoint loader --
are covered by bumping the generation: after every torch optimizer step, ``Module.load_state_dict``,
megatron-core's ``dist_checkpointing.load`` (the rollout-layout strategy's patch entries), mbridge's
``load_weights`` (the verl integration's, applied when mbridge is imported), and
``invalidate_weight_caches()`` for any other writer.
``MINDSPEED_TP_CHECK_WEIGHT_CACHES=1``: every cache hit also compares a checksum of the weight with
the one taken when the entry was made, and a stale entry is refused (``weight_cache_stale``).
"""
import os
from typing import Callable, List, Optional, Sequence

import torch

from ..contract.refusals import refuse

CHECK_ENV = "MINDSPEED_TP_CHECK_WEIGHT_CACHES"
_generation = 0
_droppers: List[Callable[[], None]] = []
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def generation() -> int:
    return _generation


def bump() -> None:
    """Every cached entry is stale from now on (recomputed at its next use)."""
    global _generation
    _generation += 1


def invalidate_weight_caches() -> None:
    """Drop every cache derived from weights (call it after writing weights through ``param.data``)."""
    bump()
    for drop in _droppers:
        drop()


def on_invalidate(drop: Callable[[], None]) -> None:
    """``drop()`` frees a cache's entries when they are invalidated."""
    if drop not in _droppers:
        _droppers.append(drop)


def checking() -> bool:
    return os.environ.get(CHECK_ENV, "").strip() not in ("", "0")


def _tensors(weights) -> Sequence[torch.Tensor]:
    return (weights,) if isinstance(weights, torch.Tensor) else tuple(weights)


def checksum(weights) -> Optional[int]:
    """The sum of the bits (as integers) of a weight or a sequence of weights, exact and cheap,
    when checking; else None."""
    if not checking():
        return None
    total = 0
    for w in _tensors(weights):
        w = w.detach().contiguous()
        total += int(torch.sum(w.view(_INT_VIEW[w.element_size()]), dtype=torch.int64))
    return total


def key(weights, *extra) -> tuple:
    """A cache entry's key for a weight (or a sequence of weights the entry derives from)."""
    return (_generation, tuple((w._version, w.data_ptr()) for w in _tensors(weights)), *extra)


def fresh(entry_key, entry_sum: Optional[int], weights, current_key, what: str) -> bool:
    """Whether a cached entry (its key and checksum) still holds for ``weights``. Checking: a
    matching key whose checksum differs is refused (a weight was written behind the cache's back)."""
    if entry_key != current_key:
        return False
    if not checking():
        return True
    if entry_sum is None:  # filled before checking was switched on: recompute once
        return False
    if checksum(weights) != entry_sum:
        raise refuse("weight_cache_stale", what=what, shape=[tuple(w.shape) for w in _tensors(weights)])
    return True


def invalidating(original):
    """A patch factory: ``original`` (a writer of weights that bumps no version counter) with the
    caches invalidated after it."""

    def wrapper(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            invalidate_weight_caches()

    wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = original.__name__, original.__qualname__, original.__doc__
    wrapper.__wrapped__ = original
    return wrapper
