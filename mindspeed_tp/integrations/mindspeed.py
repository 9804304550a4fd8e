"""Running next to MindSpeed: refuse its features that break the contract, and register our flags
as a MindSpeed feature so its argument parsing and ``repatch()`` know them.

MindSpeed (github.com/Ascend/MindSpeed, branch core_r0.16.0) applies features through
``MindSpeedFeaturesManager``: each ``MindSpeedFeature`` registers its arguments
(``register_args(parser)``), validates them (``validate_args(args)``) and registers patches
(``register_patches(patch_manager, args)``); ``import mindspeed.megatron_adaptor`` runs every
feature in ``FEATURES_LIST`` and then ``MindSpeedPatchesManager.apply_patches()``, and verl's
MindSpeed engine calls ``repatch(dict)`` (remove all patches, apply them again).

Nothing here imports mindspeed: the integration registry adds our feature to
``MindSpeedFeaturesManager.FEATURES_LIST`` once ``mindspeed.features_manager`` has been imported
and wraps ``mindspeed.megatron_adaptor.repatch``; after that adaptor ran, our targets are taken back.
"""
import functools
import sys
import warnings
from typing import Any, Optional, Tuple

from .. import state, switch
from ..contract import refusals
from ..errors import ConfigError
from ..patching import Patch, PatchRegistry
from .megatron_training import add_true_on_policy_args

FEATURES_LIST = "mindspeed.features_manager:MindSpeedFeaturesManager.FEATURES_LIST"
REPATCH = "mindspeed.megatron_adaptor:repatch"

# Allowed, but they change what mindspeed-tp sets up (a warning names them).
WARNED: Tuple[Tuple[str, str, str], ...] = (
    ("npu_deterministic", "--npu-deterministic",
     "sets HCCL_DETERMINISTIC=True when the seed is set, after mindspeed-tp set it to strict; export "
     "HCCL_DETERMINISTIC=strict in the launch environment instead"),
)


def requested(args: Any) -> bool:
    return bool(getattr(args, "true_on_policy", False) or getattr(args, "true_on_policy_profile", None))


def check_mindspeed_args(args: Any) -> None:
    """ConfigError naming every MindSpeed flag in ``args`` that breaks the contract."""
    bad = refusals.refused_flags(refusals.MINDSPEED, args)  # (flag, why), from the refusal table
    if bad:
        listed = "; ".join(f"{flag}: {why}" for flag, why in bad)
        raise ConfigError(f"MindSpeed features that break --true-on-policy are on ({listed}). Remove "
                          f"{', '.join(flag for flag, _ in bad)}, or run without mindspeed-tp")
    for attr, flag, why in WARNED:
        if getattr(args, attr, False):
            warnings.warn(f"mindspeed-tp: {flag} {why}", RuntimeWarning, stacklevel=2)


def current_mindspeed_args() -> Optional[Any]:
    """MindSpeed's view of the arguments (Megatron's once parsed), if MindSpeed is loaded."""
    args_utils = sys.modules.get("mindspeed.args_utils")
    if args_utils is None:
        return None
    try:
        return args_utils.get_full_args()
    except Exception:  # noqa: BLE001 -- MindSpeed could not parse yet: nothing to check
        return None


def check_loaded_mindspeed() -> None:
    """enable() with MindSpeed loaded: refuse its incompatible features."""
    args = current_mindspeed_args()
    if args is not None:
        check_mindspeed_args(args)


def _take_back() -> None:
    """MindSpeed (re)applied its patches over ours: enable again, which takes the targets back."""
    if state.enabled():
        switch.enable(state.profile())


def _feature_class():
    from mindspeed.features_manager.feature import MindSpeedFeature

    class TrueOnPolicyFeature(MindSpeedFeature):
        """mindspeed-tp as a MindSpeed feature: its flags, its refusals, and its patches applied
        after every other feature's (it is last in FEATURES_LIST), also on ``repatch()``."""

        def __init__(self):
            super().__init__("true-on-policy", optimization_level=0)

        def register_args(self, parser):

            add_true_on_policy_args(parser)

        def is_need_apply(self, args):
            return requested(args) or state.enabled()

        def validate_args(self, args):
            if requested(args):
                check_mindspeed_args(args)

        def register_patches(self, patch_manager, args):
            check_mindspeed_args(args)
            # Apply MindSpeed's patches first so ours go on top; the apply_patches() MindSpeed runs
            # after this loop skips what is applied.
            patch_manager.apply_patches()
            profile = getattr(args, "true_on_policy_profile", None)
            switch.enable(profile or (state.profile() if state.enabled() else None))

    return TrueOnPolicyFeature


def _with_our_feature(features_list):
    """FEATURES_LIST with TrueOnPolicyFeature appended (a new list; the original is restored on revert)."""
    return [*features_list, _feature_class()()]


def _repatch_then_take_back(repatch):
    """MindSpeed's ``repatch(dict)`` (remove all patches, apply again; verl's workers call it),
    then take our targets back -- for MindSpeed versions without a feature manager too."""

    @functools.wraps(repatch)
    def repatch_then_take_back(*args, **kwargs):
        result = repatch(*args, **kwargs)
        _take_back()
        return result

    return repatch_then_take_back


def register(reg: PatchRegistry) -> None:
    reg.add(Patch(target=FEATURES_LIST, replacement=_with_our_feature, wraps=True, on_import=True,
                  reason="mindspeed-tp as MindSpeed's last feature (TrueOnPolicyFeature): registers "
                         "--true-on-policy in MindSpeed's parser, refuses incompatible flags, applies our "
                         "patches after every other feature's"))
    reg.add(Patch(target=REPATCH, replacement=_repatch_then_take_back, wraps=True, on_import=True,
                  reason="MindSpeed's repatch() (verl's workers call it) re-applies MindSpeed's patches; take "
                         "mindspeed-tp's targets back afterwards"))


# Not a rebinding: what to do right after a module has been imported.
AFTER_IMPORT = {"mindspeed.megatron_adaptor": lambda module: _take_back()}
