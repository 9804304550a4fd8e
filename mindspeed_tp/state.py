"""Process-wide switch state: whether the patches are on and which profile they follow."""
import os
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


# The true (unpadded) vocabulary size. Megatron pads the vocabulary to a multiple of
# make_vocab_size_divisible_by x TP, so the padded size depends on TP; the logprob patch must
# exclude the padded columns, and only the true size says which they are.
_vocab_size: Optional[int] = None


def set_vocab_size(vocab_size: Optional[int]) -> None:
    """Explicit setting (``mindspeed_tp.set_vocab_size``, ``MINDSPEED_TP_VOCAB_SIZE``,
    ``--true-on-policy-vocab-size``); None clears it."""
    global _vocab_size
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab size must be a positive integer, got {vocab_size!r}")
    _vocab_size = vocab_size


def explicit_vocab_size() -> Optional[int]:
    """The explicit setting, else ``MINDSPEED_TP_VOCAB_SIZE`` from the environment (None: unset)."""
    if _vocab_size is not None:
        return _vocab_size
    raw = os.environ.get("MINDSPEED_TP_VOCAB_SIZE", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        from .errors import ConfigError

        raise ConfigError(f"MINDSPEED_TP_VOCAB_SIZE={raw!r} must be a positive integer (the model config's "
                          "vocab_size, not len(tokenizer))")
    return int(raw)


@contextmanager
def model_vocab_size(vocab_size: Optional[int]):
    """While a model computes its loss: the true vocab size its config states (None: unknown)."""
    previous = getattr(_local, "model_vocab", None)
    _local.model_vocab = vocab_size
    try:
        yield
    finally:
        _local.model_vocab = previous


def model_vocab() -> Optional[int]:
    return getattr(_local, "model_vocab", None)


@contextmanager
def scoring_sampling(sampling):
    """While logprobs are scored under processed semantics: the ``contract.sampling.Sampling``
    whose top-k / top-p mask the vocab reduction applies (None: no mask)."""
    previous = getattr(_local, "sampling", None)
    _local.sampling = sampling if sampling is not None and sampling.masks else None
    try:
        yield
    finally:
        _local.sampling = previous


def sampling_mask():
    """The ``Sampling`` whose top-k / top-p mask the logprob applies now, or None."""
    return getattr(_local, "sampling", None)
