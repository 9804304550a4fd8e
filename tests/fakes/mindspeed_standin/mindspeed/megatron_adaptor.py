"""``import mindspeed.megatron_adaptor`` applies every feature's patches; ``repatch(dict)`` removes
them all and applies them again with the dict's values set on the arguments (what verl calls)."""
from mindspeed.args_utils import get_full_args, get_mindspeed_args
from mindspeed.features_manager import MindSpeedFeaturesManager


def patch_features():
    args = get_mindspeed_args()
    MindSpeedFeaturesManager.apply_features_pre_patches(args)
    MindSpeedFeaturesManager.apply_features_patches(args)


def repatch(args):
    MindSpeedFeaturesManager.remove_patches()
    full_args = get_full_args()
    for key, value in args.items():
        setattr(full_args, key, value)
    MindSpeedFeaturesManager.apply_features_pre_patches(full_args)
    MindSpeedFeaturesManager.apply_features_patches(full_args)


patch_features()
