"""Collectives of CUDA tensors staged through host memory over gloo: several ranks on one GPU.

NCCL refuses two ranks on one device, and gloo moves CPU tensors. When the checker's ranks share
a GPU (``--device cuda`` with more local ranks than GPUs), the world runs on gloo and every
``torch.distributed`` collective that megatron-core, mindspeed-tp or the checker calls with CUDA
tensors is wrapped: its tensors are copied to host, the collective runs on the copies (in the
caller's thread, synchronously: an ``async_op`` handle is already complete), and the tensors it
writes are copied back. The same bytes move; no arithmetic changes (mindspeed-tp never lets a
collective sum; a vanilla all-reduce is summed by gloo on the host in its fixed order). Slow -- a
device-host round trip per collective -- which is fine for the checker and benchmarks on a
single-GPU machine, not for training.
"""
import functools
import inspect
from typing import List, Tuple

import torch

from ..patching import Patch, PatchRegistry

_staging = PatchRegistry("host-staging")
_device_type = "cuda"

# Collective -> the parameters it writes (copied back to the device after the host collective).
_WRITES = {
    "all_reduce": ("tensor",),
    "broadcast": ("tensor",),
    "reduce": ("tensor",),
    "all_gather": ("tensor_list",),
    "all_gather_into_tensor": ("output_tensor",),
    "reduce_scatter": ("output",),
    "reduce_scatter_tensor": ("output",),
    "all_to_all_single": ("output",),
    "all_to_all": ("output_tensor_list",),
    "gather": ("gather_list",),
    "scatter": ("tensor",),
    "send": (),
    "recv": ("tensor",),
}
# Names only some torch versions have (older private ones, newer replacements).
_WRITES_OPTIONAL = {
    "_all_gather_base": ("output_tensor",),
    "_reduce_scatter_base": ("output",),
    "all_gather_single": ("output_tensor",),
    "reduce_scatter_single": ("output",),
}


def _is_staged(obj) -> bool:
    if torch.is_tensor(obj):
        return obj.device.type == _device_type
    return isinstance(obj, (list, tuple)) and any(_is_staged(t) for t in obj)


def _to_host(obj, written: List[Tuple[torch.Tensor, torch.Tensor]], writes: bool):
    """A host copy of a device tensor (or of the device tensors in a list); a written one is
    remembered with its copy."""
    if torch.is_tensor(obj) and obj.device.type == _device_type:
        host = obj.detach().to("cpu", copy=True)
        if writes:
            written.append((obj, host))
        return host
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(t, written, writes) for t in obj)
    return obj


def _copy_back(written) -> None:
    with torch.no_grad():
        for device_tensor, host in written:
            device_tensor.copy_(host)


class _Done:
    """The handle of a staged ``async_op`` collective: it already ran."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self):
        future = torch.futures.Future()
        future.set_result([])
        return future


class _CopyBackOnWait(_Done):
    """A point-to-point handle: waiting on it waits on the host transfer, then copies back."""

    def __init__(self, work, written, keep_alive=()):
        self._work, self._written, self._keep = work, written, keep_alive
        self._finished = False

    def wait(self, timeout=None) -> bool:
        if not self._finished:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            _copy_back(self._written)
            self._finished = True
        return True

    def is_completed(self) -> bool:
        return self._finished


def _staged_collective(writes):
    def factory(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            if not any(_is_staged(v) for v in bound.arguments.values()):
                return original(*args, **kwargs)
            written: List[Tuple[torch.Tensor, torch.Tensor]] = []
            for name, value in list(bound.arguments.items()):
                bound.arguments[name] = _to_host(value, written, name in writes)
            async_op = bool(bound.arguments.get("async_op", False))
            if async_op:
                bound.arguments["async_op"] = False
            result = original(*bound.args, **bound.kwargs)
            _copy_back(written)
            return _Done() if async_op else result

        return collective

    return factory


def _staged_isend(original):
    @functools.wraps(original)
    def isend(tensor, *args, **kwargs):
        if not _is_staged(tensor):
            return original(tensor, *args, **kwargs)
        host = _to_host(tensor, [], False)
        return _CopyBackOnWait(original(host, *args, **kwargs), [], keep_alive=(host,))

    return isend


def _staged_irecv(original):
    @functools.wraps(original)
    def irecv(tensor, *args, **kwargs):
        if not _is_staged(tensor):
            return original(tensor, *args, **kwargs)
        written: List[Tuple[torch.Tensor, torch.Tensor]] = []
        host = _to_host(tensor, written, True)
        return _CopyBackOnWait(original(host, *args, **kwargs), written)

    return irecv


def _staged_batch_isend_irecv(original):
    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list):
        import torch.distributed as dist

        if not any(_is_staged(op.tensor) for op in p2p_op_list):
            return original(p2p_op_list)
        host_ops, written, keep = [], [], []
        for op in p2p_op_list:
            receives = getattr(op.op, "__name__", "") == "irecv"
            host = _to_host(op.tensor, written, receives)
            keep.append(host)
            host_ops.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
        works = original(host_ops)
        # Every receive is complete once all handles are waited on: copy back on the last one.
        handles = [_CopyBackOnWait(w, []) for w in works]
        if handles:
            handles[-1] = _CopyBackOnWait(_AllOf(works), written, keep_alive=tuple(keep))
        return handles

    return batch_isend_irecv


class _AllOf:
    def __init__(self, works):
        self._works = works

    def wait(self, timeout=None):
        for w in self._works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


_REASON = ("several ranks on one GPU (NCCL refuses that): {name} of CUDA tensors runs on host copies over "
           "gloo, written tensors are copied back")
for _name, _writes in [*_WRITES.items(), *_WRITES_OPTIONAL.items()]:
    _staging.add(Patch(target=f"torch.distributed:{_name}", replacement=_staged_collective(_writes),
                       reason=_REASON.format(name=_name), wraps=True, optional=_name in _WRITES_OPTIONAL))
_staging.add(Patch(target="torch.distributed:isend", replacement=_staged_isend, reason=_REASON.format(name="isend"),
                   wraps=True))
_staging.add(Patch(target="torch.distributed:irecv", replacement=_staged_irecv, reason=_REASON.format(name="irecv"),
                   wraps=True))
_staging.add(Patch(target="torch.distributed:batch_isend_irecv", replacement=_staged_batch_isend_irecv,
                   reason=_REASON.format(name="batch_isend_irecv"), wraps=True))
del _name, _writes


def install_host_staging(device_type: str = "cuda") -> None:
    """Stage the collectives of ``device_type`` tensors through host memory (idempotent).
    ``device_type`` other than cuda is for tests: "cpu" stages CPU tensors through copies."""
    global _device_type
    _device_type = device_type
    _staging.apply()


def remove_host_staging() -> None:
    _staging.revert()


def staging_registry() -> PatchRegistry:
    return _staging


def ranks_share_a_device(local_world_size: int, device_count: int) -> bool:
    """More local ranks than GPUs: some ranks share one, so NCCL cannot connect them."""
    return local_world_size > device_count
