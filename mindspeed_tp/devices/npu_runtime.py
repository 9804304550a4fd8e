"""The Ascend packages the npu backend calls, and the environment the Ascend collectives need.

Nothing here is imported unless the npu backend is requested (profile ``backend: npu``, or
``auto`` with an NPU present), so machines without torch_npu import and run the package as
before. A missing piece is a ConfigError naming the package to install.

Where the names come from (read in their public sources, 2026-07/08):

- ``torch.ops.batch_invariant_ops.npu_{mm,matmul,reduce_sum,log_softmax}_batch_invariant``: the
  CANN ops-batchinvariant custom ops, registered by ``import batch_invariant_ops`` (the torch
  extension wheel); argument lists as MindSpeed core_r0.16.0 calls them in
  ``mindspeed/core/batch_invariant/batch_invariant.py`` (``(a, b)``, ``(a, b)``,
  ``(x, dim, keepdim)`` with dim the last dim, ``(x, dim)``).
- ``flash_attn_npu.flash_attn_func``: flash-attention-npu (github.com/MinghuasLab/flash-attention-npu),
  package ``flash_attn_npu`` (called ``flash_attn_npu_v2`` before its 2026-07-30 rename), the
  one MindSpeed's ``--use-flash-attn-npu-batch-invariant`` imports.
- ``flash_attn_with_kvcache`` of the v3 package: ``flash_attn_npu_v3`` (the name vLLM-Ascend's
  FA3 backend imports), renamed ``flash_attn_npu_3`` in flash-attention-npu on 2026-07-30; either
  name is accepted.
"""
import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, MutableMapping, Optional

from ..errors import ConfigError

# Fixed-order collectives on Ascend: HCCL (inter-node / general) and LCCL (intra-node).
DETERMINISTIC_ENV: Dict[str, str] = {"HCCL_DETERMINISTIC": "strict", "LCCL_DETERMINISTIC": "1"}

BATCH_INVARIANT_OPS = (
    "npu_mm_batch_invariant",
    "npu_matmul_batch_invariant",
    "npu_reduce_sum_batch_invariant",
    "npu_log_softmax_batch_invariant",
)
_DECODE_PACKAGES = ("flash_attn_npu_v3", "flash_attn_npu_3")

_INSTALL = {
    "torch_npu": "install torch_npu matching your torch (e.g. torch==2.9.0 with torch_npu==2.9.0) and CANN",
    "batch_invariant_ops": "install CANN's ops-batchinvariant run package and its batch_invariant_ops "
                           "torch extension wheel",
    "flash_attn_npu": "build flash-attention-npu with FLASH_ATTN_BUILD_VERSION=v2 (package flash_attn_npu)",
    "flash_attn_npu_v3": "build flash-attention-npu with FLASH_ATTN_BUILD_VERSION=v3 (package flash_attn_npu_v3 "
                         "or flash_attn_npu_3)",
}


@dataclass(frozen=True)
class NpuOps:
    """The callables the npu kernels use, resolved once."""

    mm: Callable[..., Any]
    matmul: Callable[..., Any]
    reduce_sum: Callable[..., Any]
    log_softmax: Callable[..., Any]
    flash_attn_func: Callable[..., Any]
    flash_attn_with_kvcache: Callable[..., Any]


_ops: Optional[NpuOps] = None


_BACKEND = "the npu kernel backend (profile backend: npu, or auto with an NPU)"
_OR_TORCH = "; or set the profile's backend: torch"


def _missing(package: str, why: str, who: str = _BACKEND, alternative: str = _OR_TORCH) -> ConfigError:
    return ConfigError(f"{who} needs the package {package!r}, which {why}: {_INSTALL[package]}{alternative}")


def import_required(name: str, install_key: str, who: str = _BACKEND, alternative: str = _OR_TORCH):
    """Import an Ascend package; a ConfigError names it (and what needs it) when it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _missing(install_key, f"cannot be imported ({exc})", who, alternative) from exc
    except RuntimeError as exc:  # flash_attn_npu raises RuntimeError on an unsupported device
        raise _missing(install_key, f"failed to load ({exc})", who, alternative) from exc


def load() -> NpuOps:
    """Import every Ascend piece the npu backend calls (cached); ConfigError names a missing one."""
    global _ops
    if _ops is not None:
        return _ops
    import torch

    import_required("torch_npu", "torch_npu")
    import_required("batch_invariant_ops", "batch_invariant_ops")
    namespace = getattr(torch.ops, "batch_invariant_ops")
    found = {}
    for op in BATCH_INVARIANT_OPS:
        try:
            found[op] = getattr(namespace, op)
        except (AttributeError, RuntimeError) as exc:
            raise _missing("batch_invariant_ops", f"does not register torch.ops.batch_invariant_ops.{op}") from exc
    train = import_required("flash_attn_npu", "flash_attn_npu")
    if not hasattr(train, "flash_attn_func"):
        raise _missing("flash_attn_npu", "has no flash_attn_func")
    decode = None
    errors = []
    for name in _DECODE_PACKAGES:
        try:
            decode = importlib.import_module(name)
            break
        except (ImportError, RuntimeError) as exc:
            errors.append(f"{name}: {exc}")
    if decode is None:
        raise _missing("flash_attn_npu_v3", "cannot be imported (" + "; ".join(errors) + ")")
    if not hasattr(decode, "flash_attn_with_kvcache"):
        raise _missing("flash_attn_npu_v3", f"({decode.__name__}) has no flash_attn_with_kvcache")
    _ops = NpuOps(
        mm=found["npu_mm_batch_invariant"],
        matmul=found["npu_matmul_batch_invariant"],
        reduce_sum=found["npu_reduce_sum_batch_invariant"],
        log_softmax=found["npu_log_softmax_batch_invariant"],
        flash_attn_func=train.flash_attn_func,
        flash_attn_with_kvcache=decode.flash_attn_with_kvcache,
    )
    return _ops


def reset() -> None:
    """Forget the loaded ops (tests swap the packages)."""
    global _ops
    _ops = None


def set_collective_env(environ: Optional[MutableMapping[str, str]] = None) -> List[str]:
    """Set HCCL_DETERMINISTIC=strict and LCCL_DETERMINISTIC=1; warn naming any value replaced.

    Returns the variables whose value changed. HCCL/LCCL read them when a communicator is created,
    so a change after torch.distributed is initialised may come too late: the warning says so.
    """
    environ = os.environ if environ is None else environ
    changed = []
    for var, wanted in DETERMINISTIC_ENV.items():
        current = environ.get(var)
        if current is not None and current.strip().lower() == wanted:
            continue
        if current is not None:
            warnings.warn(
                f"mindspeed-tp: {var}={current!r} conflicts with the fixed collective order the npu backend "
                f"needs; setting {var}={wanted} (set it so in the launch environment to silence this)",
                RuntimeWarning, stacklevel=3)
        environ[var] = wanted
        changed.append(var)
    if changed and _distributed_initialized():
        warnings.warn(
            f"mindspeed-tp: {', '.join(changed)} set after torch.distributed was initialised; communicators "
            f"created before keep the old value. Export {', '.join(f'{v}={DETERMINISTIC_ENV[v]}' for v in changed)} "
            f"before launching (torchrun / verl workers)", RuntimeWarning, stacklevel=3)
    return changed


def _distributed_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def prepare() -> NpuOps:
    """What enable() runs for the npu backend: load the packages, fix the collective environment."""
    ops = load()
    set_collective_env()
    return ops
