"""Errors raised for settings that cannot keep the numerics contract."""


class ConfigError(ValueError):
    """A setting makes bitwise parity impossible; the message names the setting to change.

    The checker maps this to exit code 2. Raised at startup, never swallowed: the alternative
    would be a silent fallback to the non-invariant path.
    """


class PatchTargetError(RuntimeError):
    """The installed megatron-core lacks a symbol that a patch must replace."""


class PatchImportError(PatchTargetError):
    """A patch target's module exists but its import failed (e.g. a dependency megatron-core does not
    declare is missing); raised even for optional patches: skipping them would hide a broken install."""
