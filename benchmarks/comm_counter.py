"""Counts the bytes each rank sends through torch.distributed collectives (ring-algorithm
estimates), by wrapping the collectives with the patch registry -- which also rebinds the aliases
megatron-core takes at import (e.g. ``dist_all_gather_func``)."""
import torch
import torch.distributed as dist

from mindspeed_tp.patching import Patch, PatchRegistry

BYTES = {"total": 0}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


# Position of the ``group`` argument when it is passed positionally.
_GROUP_ARG = {"all_reduce": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3, "all_to_all_single": 4,
              "all_gather": 2, "send": 2}


def _counting(name, size_of):
    def factory(original):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            if group is None and len(args) > _GROUP_ARG[name] and isinstance(args[_GROUP_ARG[name]], dist.ProcessGroup):
                group = args[_GROUP_ARG[name]]
            n = dist.get_world_size(group=group)
            BYTES["total"] += int(size_of(args, n))
            return original(*args, **kwargs)

        return wrapper

    return factory


_RULES = {
    "all_reduce": lambda a, n: 2 * (n - 1) / n * _nbytes(a[0]),
    "all_gather_into_tensor": lambda a, n: (n - 1) / n * _nbytes(a[0]),
    "reduce_scatter_tensor": lambda a, n: (n - 1) / n * _nbytes(a[1]),
    "all_to_all_single": lambda a, n: (n - 1) / n * _nbytes(a[1]),
    "all_gather": lambda a, n: (n - 1) / n * _nbytes(a[0]),
    "send": lambda a, n: _nbytes(a[0]),
}

counter = PatchRegistry("comm-counter")
for _name, _rule in _RULES.items():
    counter.add(Patch(target=f"torch.distributed:{_name}", replacement=_counting(_name, _rule),
                      reason="count collective bytes for the benchmark", wraps=True))


def reset() -> None:
    BYTES["total"] = 0


def total() -> int:
    return BYTES["total"]
