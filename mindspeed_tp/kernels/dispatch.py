"""The kernel backend table: which backend module runs a kernel call.

Every backend is one module under ``kernels/backends/`` implementing the same primitive kernels
(``PRIMITIVES``); the composite kernels in ``kernels/`` (canonical-tree leaves, logprob, norms,
routing) are written once on top of them. A call picks its backend from the profile's ``backend``
(set by ``enable()``; ``auto`` until then) and the tensor's device:

- ``auto``: CPU tensors -> ``torch`` (the reference kernels), NPU tensors -> ``npu``, CUDA tensors
  -> ``triton``. ``torch``, ``npu`` or ``triton`` in the profile force that backend for every call.
- The torch reference kernels are batch-invariant on CPU only (row padding steers MKL; cuBLAS may
  change algorithm or split-K with the shape, and TF32), so they refuse CUDA tensors.

A backend missing from this build, or missing a kernel, is a ConfigError naming both.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict

from ..contract.profile import BACKENDS
from ..contract.refusals import refuse
from ..errors import ConfigError

# Backend name -> module implementing the primitives. "auto" is a selection rule, not a backend.
BACKEND_MODULES: Dict[str, str] = {
    "torch": "mindspeed_tp.kernels.backends.torch",
    "npu": "mindspeed_tp.kernels.backends.npu",
    "triton": "mindspeed_tp.kernels.backends.triton",
}
# What "auto" runs for a tensor on each device type.
AUTO_BY_DEVICE: Dict[str, str] = {"cpu": "torch", "npu": "npu", "cuda": "triton"}
# Device types a backend is known not to be batch-invariant on: the torch backend's invariance is a
# property of the CPU BLAS libraries (kernels/backends/torch.py), not of cuBLAS or the NPU's kernels.
NOT_INVARIANT_ON: Dict[str, tuple] = {"torch": ("cuda", "npu")}

# The primitive kernels every backend implements (semantics: kernels/backends/torch.py).
PRIMITIVES = ("matmul", "linear", "grad_matmul", "row_sum", "row_mean", "softmax", "attention", "decode_attention")

_selected = "auto"
_modules: Dict[str, ModuleType] = {}


def select(name: str) -> None:
    """Remember the profile's backend choice (``enable()`` / ``disable()``)."""
    global _selected
    if name not in BACKENDS:
        raise ConfigError(f"profile field 'backend' must be one of {BACKENDS}, got {name!r}")
    _selected = name


def selected() -> str:
    return _selected


def backend_for_device(device_type: str, choice: str = None) -> str:
    choice = _selected if choice is None else choice
    if choice != "auto":
        return choice
    try:
        return AUTO_BY_DEVICE[device_type]
    except KeyError:
        raise ConfigError(f"no mindspeed-tp kernel backend runs tensors on device type {device_type!r}; "
                          f"backends: {sorted(BACKEND_MODULES)}") from None


def backend_name(tensor) -> str:
    """The backend a kernel call on ``tensor`` goes to."""
    name = backend_for_device(tensor.device.type)
    if tensor.device.type in NOT_INVARIANT_ON.get(name, ()):
        raise refuse("backend_not_invariant", backend=name, device=tensor.device.type,
                     auto=AUTO_BY_DEVICE[tensor.device.type])
    return name


def backend_module(name: str) -> ModuleType:
    module = _modules.get(name)
    if module is not None:
        return module
    path = BACKEND_MODULES.get(name)
    if path is None:
        raise ConfigError(f"the {name!r} kernel backend is not part of this mindspeed-tp build (available: "
                          f"{sorted(BACKEND_MODULES)})")
    module = _modules[name] = importlib.import_module(path)
    return module


def kernel(name: str, tensor):
    """The ``name`` primitive of the backend that runs ``tensor``."""
    backend = backend_name(tensor)
    fn = getattr(backend_module(backend), name, None)
    if fn is None:
        raise ConfigError(f"the {backend} kernel backend does not implement the kernel {name!r}")
    return fn


def backend_attribute(tensor, attr: str, default=None):
    """A property the backend declares (e.g. ``EXPLICIT_MASKS``)."""
    return getattr(backend_module(backend_name(tensor)), attr, default)


def build_identity(device_type: str) -> dict:
    """What the compiled kernels of the backend running ``device_type`` depend on beyond the profile
    (the triton backend: its Triton version and the FP contraction pinned at launch); empty for a
    backend that declares none. A report shows it, ranks compare it, a reference file records it."""
    identity = getattr(backend_module(backend_for_device(device_type)), "build_identity", None)
    return identity() if identity is not None else {}


def release() -> None:
    """What disable() runs: each loaded backend that prepared something process-wide puts it back
    (the triton backend's pinned TF32 / cuDNN / reduced-precision flags); none is imported here."""
    for module in list(_modules.values()):
        undo = getattr(module, "release", None)
        if undo is not None:
            undo()


def prepare(profile, device_type: str) -> str:
    """What enable() runs: select the profile's backend and prepare the one this machine's
    tensors will use (load its packages, pin its environment); returns its name."""
    name = backend_for_device(device_type, profile.backend)
    module = backend_module(name)
    missing = [k for k in PRIMITIVES if not callable(getattr(module, k, None))]
    if missing:
        raise ConfigError(f"the {name} kernel backend does not implement the kernel(s) {missing}")
    ready = getattr(module, "prepare", None)
    if ready is not None:
        ready(profile)
    select(profile.backend)
    return name
