"""mindspeed-tp: bitwise-consistent log-probabilities for Megatron-core / MindSpeed in any layout.

Four equivalent switches apply the same patches exactly once:
``import mindspeed_tp.megatron_adaptor``, ``mindspeed_tp.enable(profile=...)``, the environment
variable ``MINDSPEED_TP=1`` (profile from ``MINDSPEED_TP_PROFILE``), and the training-script flags
``--true-on-policy`` / ``--true-on-policy-profile PATH``. Map of the package:
docs/DEVELOPING.md; the numerics contract: docs/CONTRACT.md.
"""
import os
from typing import Optional

import mindspeed_tp_autoload as _autoload

from . import integrations as _integrations
from .contract.profile import Profile, load_profile
from .errors import ConfigError, PatchTargetError
from .switch import disable, enable, is_enabled

__version__ = "0.1.0"


def set_vocab_size(vocab_size: Optional[int]) -> None:
    """The true (unpadded) vocabulary size, so the logprob/loss patch excludes the columns Megatron
    pads (``make_vocab_size_divisible_by`` x TP) exactly; also ``MINDSPEED_TP_VOCAB_SIZE`` or
    ``--true-on-policy-vocab-size``. A model config with a ``vocab_size`` field (Megatron-Bridge
    providers) states it too. None clears the setting."""
    from . import state

    state.set_vocab_size(vocab_size)


def invalidate_weight_caches() -> None:
    """Drop every cache derived from weights (the rollout layout's re-laid weights, the vLLM
    engine's prepacked ones): call it after writing weights through ``param.data`` outside an
    optimizer step or a checkpoint load (``MINDSPEED_TP_CHECK_WEIGHT_CACHES=1`` finds such writes)."""
    from .numerics.weight_caches import invalidate_weight_caches as invalidate

    invalidate()


_integrations.install(_autoload.when_imported)  # import-time patches of verl, MindSpeed, Megatron-LM

if _autoload.env_requested():  # MINDSPEED_TP=1 and the package was imported explicitly: enable now
    enable(os.environ.get("MINDSPEED_TP_PROFILE") or None)

__all__ = ["ConfigError", "PatchTargetError", "Profile", "disable", "enable", "invalidate_weight_caches", "is_enabled",
           "load_profile", "set_vocab_size"]
