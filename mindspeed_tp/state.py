"""Process-wide switch state: whether the patches are on and which profile they follow."""
import threading
from contextlib import contextmanager
from typing import Optional

from .contract.profile import Profile

_profile: Optional[Profile] = None
_local = threading.local()


def set_profile(profile: Optional[Profile]) -> None:
    global _profile
    _profile = profile


def profile() -> Profile:
    """The active profile; patched code only runs while one is set."""
    if _profile is None:
        raise RuntimeError("mindspeed-tp patches are running without an active profile; call enable()")
    return _profile


def enabled() -> bool:
    return _profile is not None


@contextmanager
def fp32_output():
    """Within this context the invariant linear returns fp32 (used for the LM head's logits)."""
    previous = getattr(_local, "fp32_output", False)
    _local.fp32_output = True
    try:
        yield
    finally:
        _local.fp32_output = previous


def want_fp32_output() -> bool:
    return getattr(_local, "fp32_output", False)

