"""Row-parallel weights re-laid out by output columns, cached per weight version (rollout_layout).

A row-parallel weight is sharded along K: rank t holds W[:, K_t] (N, K/T). To reproduce a rollout
engine's full-K (or K/R) GEMMs, rank t needs W[N_t, :] (N/T, K): the same number of elements,
obtained by one all-to-all of weight blocks. The result is cached on the parameter and reused
until the weight changes (``numerics/weight_caches.py`` says when: an optimizer step, an in-place
edit, a new ``param.data``, a checkpoint load, ``invalidate_relaid_weights()`` /
``mindspeed_tp.invalidate_weight_caches()``). Autograd: gradients of the re-laid weight go back
through the inverse all-to-all to the original shard (the parameter itself), cached or not.

Every rank of the group must see the same cache state (the recompute is a collective): weights
change in lockstep in data/tensor-parallel training. If a job edits weights on some ranks only,
call ``invalidate_relaid_weights()`` on all of them, or ``set_relaid_cache(False)``.
"""
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ...kernels.collectives import all_to_all_slots, group_rank, group_size
from .. import weight_caches

_ATTR = "_mindspeed_tp_relaid"
_cache_enabled = True
_cached = {}  # id(parameter) -> weakref to every parameter holding a cached re-laid copy


def _drop_relaid() -> None:
    for param in _live_cached():
        if hasattr(param, _ATTR):
            delattr(param, _ATTR)
    _cached.clear()


weight_caches.on_invalidate(_drop_relaid)


def invalidate_relaid_weights() -> None:
    """Drop every cached weight (e.g. after writing weights through ``param.data``)."""
    weight_caches.invalidate_weight_caches()


def _live_cached():
    return [p for p in (ref() for ref in list(_cached.values())) if p is not None]


def set_relaid_cache(enabled: bool) -> None:
    """Enable (default) or disable the cache; disabled, every forward re-lays the weights."""
    global _cache_enabled
    _cache_enabled = bool(enabled)
    if not enabled:
        invalidate_relaid_weights()


def relaid_cache_bytes() -> int:
    """Bytes held by cached re-laid weights in this process (the mode's extra weight memory)."""
    return sum(getattr(p, _ATTR)[1].numel() * getattr(p, _ATTR)[1].element_size() for p in _live_cached()
               if hasattr(p, _ATTR))


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    weight_caches.bump()


def install_optimizer_hook():
    """Bump the generation after every torch optimizer's step (a registry Hook: enable() installs
    it, disable() removes it); returns the handle."""
    return register_optimizer_step_post_hook(_on_optimizer_step)


def _relay(weight: torch.Tensor, group) -> torch.Tensor:
    """(N, K/T) row-parallel shard -> (N/T, K): this rank's output rows with every K shard."""
    world = group_size(group)
    n, kt = weight.shape
    if n % world:
        raise ValueError(f"output size {n} does not split over {world} ranks")
    received = all_to_all_slots(weight.detach().contiguous(), group)  # slot s: W[N_t, K_s]
    return received.permute(1, 0, 2).reshape(n // world, world * kt)


def _unrelay(grad: torch.Tensor, group) -> torch.Tensor:
    """Inverse of ``_relay`` for gradients: (N/T, K) -> (N, K/T)."""
    world = group_size(group)
    rows, k = grad.shape
    blocks = grad.reshape(rows, world, k // world).permute(1, 0, 2).reshape(world * rows, k // world)
    return all_to_all_slots(blocks, group).reshape(world * rows, k // world)


def _key(weight: torch.Tensor, group):
    return weight_caches.key(weight, group_size(group), group_rank(group))


class _RelaidWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        entry = getattr(weight, _ATTR, None) if _cache_enabled else None
        key = _key(weight, group)
        if entry is None or not weight_caches.fresh(entry[0], entry[2], weight, key, "a re-laid row-parallel weight"):
            relaid = _relay(weight, group)
            if _cache_enabled:
                setattr(weight, _ATTR, (key, relaid, weight_caches.checksum(weight)))
                _cached[id(weight)] = weakref.ref(weight)
        else:
            relaid = entry[1]
        return relaid.detach()  # a fresh alias: autograd metadata never lands on the cached tensor

    @staticmethod
    def backward(ctx, grad):
        return _unrelay(grad.contiguous(), ctx.group), None


def relaid_weight(weight: torch.Tensor, group) -> torch.Tensor:
    """W[N_t, :] for this rank t of ``group`` from the K-sharded ``weight``; differentiable."""
    if group_size(group) == 1:
        return weight
    return _RelaidWeight.apply(weight, group)


__all__ = ["invalidate_relaid_weights", "relaid_cache_bytes", "relaid_weight", "set_relaid_cache"]
