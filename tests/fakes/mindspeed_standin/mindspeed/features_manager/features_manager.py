from mindspeed.patch_utils import MindSpeedPatchesManager


class MindSpeedFeaturesManager:
    FEATURES_LIST = []

    @classmethod
    def set_features_list(cls, features_list):
        cls.FEATURES_LIST[:] = features_list

    @classmethod
    def apply_features_pre_patches(cls, args):
        for feature in cls.FEATURES_LIST:
            if feature.is_need_apply(args):
                feature.pre_register_patches(MindSpeedPatchesManager, args)
        MindSpeedPatchesManager.apply_patches()

    @classmethod
    def apply_features_patches(cls, args):
        for feature in cls.FEATURES_LIST:
            if feature.is_need_apply(args):
                feature.register_patches(MindSpeedPatchesManager, args)
        MindSpeedPatchesManager.apply_patches()

    @classmethod
    def register_features_args(cls, parser):
        for feature in cls.FEATURES_LIST:
            feature.register_args(parser)

    @classmethod
    def validate_features_args(cls, args):
        for feature in cls.FEATURES_LIST:
            feature.validate_args(args)

    @classmethod
    def remove_patches(cls):
        MindSpeedPatchesManager.remove_patches()
