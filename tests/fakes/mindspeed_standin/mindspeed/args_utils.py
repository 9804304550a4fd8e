import argparse

from mindspeed.features_manager import MindSpeedFeaturesManager

_ARGS = None


def get_mindspeed_args():
    """Features' arguments parsed from sys.argv, unknown ones tolerated (as MindSpeed does)."""
    global _ARGS
    if _ARGS is None:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        MindSpeedFeaturesManager.register_features_args(parser)
        _ARGS, _ = parser.parse_known_args()
    return _ARGS


def get_full_args():
    return get_mindspeed_args()
