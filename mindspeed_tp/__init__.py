"""mindspeed-tp: bitwise-consistent log-probabilities for Megatron-core / MindSpeed in any layout.

Four equivalent switches apply the same patches exactly once:
``import mindspeed_tp.megatron_adaptor``, ``mindspeed_tp.enable(profile=...)``, the environment
variable ``MINDSPEED_TP=1`` (profile from ``MINDSPEED_TP_PROFILE``), and the training-script flags
``--true-on-policy`` / ``--true-on-policy-profile PATH``.
"""
import os
import sys
import threading
from typing import Optional, Union

from .errors import ConfigError, PatchTargetError
from .profile import Profile, load_profile

__version__ = "0.1.0"

_lock = threading.RLock()


def enable(profile: Union[str, Profile, None] = None) -> Profile:
    """Apply the numerics patches (idempotent) under ``profile`` (name, YAML path or Profile).

    Enabling again with a different profile switches the profile; the patches stay applied once,
    and targets someone rebound since (MindSpeed imported later, its ``repatch()``) are taken back.
    """
    from . import state
    from .backends import ensure_backend_ready
    from .patches import registry

    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    with _lock:
        if "mindspeed" in sys.modules:  # refuse MindSpeed features that break the contract
            from .mindspeed_compat import check_loaded_mindspeed

            check_loaded_mindspeed()
        ensure_backend_ready(prof)
        state.set_profile(prof)
        registry().apply()
    return prof


def disable() -> None:
    """Restore every original megatron-core symbol (vanilla behaviour)."""
    from . import state
    from .patches import registry

    from .backends import set_backend

    with _lock:
        registry().revert()
        state.set_profile(None)
        set_backend("auto")


def set_vocab_size(vocab_size: Optional[int]) -> None:
    """The true (unpadded) vocabulary size, so the logprob/loss patch excludes the columns Megatron
    pads (``make_vocab_size_divisible_by`` x TP) exactly; also ``MINDSPEED_TP_VOCAB_SIZE`` or
    ``--true-on-policy-vocab-size``. A model config with a ``vocab_size`` field (Megatron-Bridge
    providers) states it too. None clears the setting."""
    from . import state

    state.set_vocab_size(vocab_size)


def is_enabled() -> bool:
    from . import state

    return state.enabled()


import mindspeed_tp_autoload as _autoload  # noqa: E402  (megatron.training flags; MINDSPEED_TP=1 hook)
from .mindspeed_compat import install_hooks as _install_mindspeed_hooks  # noqa: E402

_install_mindspeed_hooks(_autoload.when_imported)  # our feature in MindSpeed's manager; take back after it

if _autoload.env_requested():  # the package was imported explicitly: enable now
    enable(os.environ.get("MINDSPEED_TP_PROFILE") or None)

__all__ = ["ConfigError", "PatchTargetError", "Profile", "disable", "enable", "is_enabled", "load_profile",
           "set_vocab_size"]
