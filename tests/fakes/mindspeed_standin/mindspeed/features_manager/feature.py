"""MindSpeedFeature base with the real one's interface."""


class MindSpeedFeature:
    def __init__(self, feature_name: str, optimization_level: int = 2):
        self.feature_name = feature_name.lower().strip().replace("-", "_")
        self.optimization_level = optimization_level
        self.default_patches = self.optimization_level == 0

    def is_need_apply(self, args):
        return (self.optimization_level <= getattr(args, "optimization_level", 2)
                and getattr(args, self.feature_name, None)) or self.default_patches

    def register_args(self, parser):
        pass

    def validate_args(self, args):
        pass

    def pre_register_patches(self, patch_manager, args):
        pass

    def register_patches(self, patch_manager, args):
        pass
