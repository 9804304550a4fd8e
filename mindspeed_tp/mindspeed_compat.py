"""Running next to MindSpeed: refuse its features that break the contract, and register our flags
as a MindSpeed feature so its argument parsing and ``repatch()`` know them.

MindSpeed (github.com/Ascend/MindSpeed, branch core_r0.16.0) applies features through
``MindSpeedFeaturesManager``: each ``MindSpeedFeature`` registers its arguments
(``register_args(parser)``), validates them (``validate_args(args)``) and registers patches
(``register_patches(patch_manager, args)``); ``import mindspeed.megatron_adaptor`` runs every
feature in ``FEATURES_LIST`` and then ``MindSpeedPatchesManager.apply_patches()``, and verl's
MindSpeed engine calls ``repatch(dict)`` (remove all patches, apply them again).

Nothing here imports mindspeed: ``install_hooks`` (run when the package is imported) registers the
feature once ``mindspeed.features_manager`` has been imported, and takes our targets back after
``mindspeed.megatron_adaptor`` ran.
"""
import sys
import warnings
from typing import Any, Optional, Tuple

from .errors import ConfigError

# (args attribute, flag, why it breaks the bitwise-logprob contract). README "Ascend" lists them.
INCOMPATIBLE: Tuple[Tuple[str, str, str], ...] = (
    ("use_ascend_mc2", "--use-ascend-mc2",
     "MC2 replaces Column/RowParallelLinear with fused matmul+all-gather/reduce-scatter kernels: partial "
     "sums are added inside the collective, not in the canonical tree"),
    ("use_ascend_coc", "--use-ascend-coc",
     "CoC replaces the TP linears with chunked GEMMs overlapped with reduce-scatter/all-reduce: the "
     "collective does the sum"),
    ("unaligned_linear", "--unaligned-linear",
     "unaligned TP linears give ranks shards that are not whole canonical leaves"),
    ("tp_2d", "--tp-2d",
     "2-D tensor parallelism replaces linears, norms and embeddings and sums over two groups"),
    ("use_fused_rmsnorm", "--use-fused-rmsnorm",
     "the fused torch_npu RMSNorm has its own reduction order; mindspeed-tp computes RMSNorm itself "
     "(fp32, batch-invariant reduce), so the flag would silently not apply"),
    ("moe_permute_fusion", "--moe-permute-fusion",
     "fused token permute/unpermute kernels; the MoE patch dispatches rows itself"),
    ("use_fused_moe_token_permute_and_unpermute", "--use-fused-moe-token-permute-and-unpermute",
     "fused token permute/unpermute kernels; the MoE patch dispatches rows itself"),
    ("moe_tp_extend_ep", "--moe-tp-extend-ep",
     "experts sharded over TPxEP with a patched router: routing and expert GEMMs depend on the layout"),
    ("moe_alltoall_overlap_comm", "--moe-alltoall-overlap-comm",
     "replaces MLP.forward and the dispatcher with overlapped versions that combine through collectives"),
    ("moe_allgather_overlap_comm", "--moe-allgather-overlap-comm",
     "replaces MLP.forward and the dispatcher with overlapped versions that combine through collectives"),
    ("moe_fb_overlap", "--moe-fb-overlap",
     "forward-backward overlap replaces the transformer block and schedules, bypassing the MoE patch"),
    ("balanced_moe_experts", "--balanced-moe-experts",
     "replicates hot experts on other ranks, so a token's expert GEMM runs where the layout puts it"),
)

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
    bad = [(flag, why) for attr, flag, why in INCOMPATIBLE if getattr(args, attr, False)]
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


def _feature_class():
    from mindspeed.features_manager.feature import MindSpeedFeature

    class TrueOnPolicyFeature(MindSpeedFeature):
        """mindspeed-tp as a MindSpeed feature: its flags, its refusals, and its patches applied
        after every other feature's (it is last in FEATURES_LIST), also on ``repatch()``."""

        def __init__(self):
            super().__init__("true-on-policy", optimization_level=0)

        def register_args(self, parser):
            from .training_args import add_true_on_policy_args

            add_true_on_policy_args(parser)

        def is_need_apply(self, args):
            import mindspeed_tp

            return requested(args) or mindspeed_tp.is_enabled()

        def validate_args(self, args):
            if requested(args):
                check_mindspeed_args(args)

        def register_patches(self, patch_manager, args):
            import mindspeed_tp
            from . import state

            check_mindspeed_args(args)
            # Apply MindSpeed's patches first so ours go on top; the apply_patches() MindSpeed runs
            # after this loop skips what is applied.
            patch_manager.apply_patches()
            profile = getattr(args, "true_on_policy_profile", None)
            mindspeed_tp.enable(profile or (state.profile() if state.enabled() else None))

    return TrueOnPolicyFeature


def register_feature(features_manager_module=None) -> bool:
    """Add the feature to MindSpeed's feature manager once; False when MindSpeed has none."""
    module = features_manager_module or sys.modules.get("mindspeed.features_manager")
    manager = getattr(module, "MindSpeedFeaturesManager", None)
    if manager is None or not hasattr(manager, "FEATURES_LIST"):
        return False
    if any(type(f).__name__ == "TrueOnPolicyFeature" for f in manager.FEATURES_LIST):
        return True
    manager.FEATURES_LIST.append(_feature_class()())
    return True



def after_mindspeed_adaptor(module) -> None:
    """Right after ``import mindspeed.megatron_adaptor`` (which applied MindSpeed's patches): if
    mindspeed-tp is on, take its targets back, and do so again after every ``repatch()`` (MindSpeed
    versions without a feature manager, where the feature above cannot do it)."""
    import functools

    import mindspeed_tp
    from . import state

    if state.enabled():
        mindspeed_tp.enable(state.profile())
    repatch = getattr(module, "repatch", None)
    if repatch is None or getattr(repatch, "_mindspeed_tp", False):
        return

    @functools.wraps(repatch)
    def repatch_then_take_back(*args, **kwargs):
        result = repatch(*args, **kwargs)
        if state.enabled():
            mindspeed_tp.enable(state.profile())
        return result

    repatch_then_take_back._mindspeed_tp = True
    module.repatch = repatch_then_take_back


def _on_features_manager(module) -> None:
    register_feature(module)


def install_hooks(when_imported) -> None:
    """Register the post-import hooks (``mindspeed_tp_autoload.when_imported``); once per process."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    when_imported("mindspeed.features_manager", _on_features_manager)
    when_imported("mindspeed.megatron_adaptor", after_mindspeed_adaptor)


_hooks_installed = False
