"""Megatron-style training-script flags: ``--true-on-policy``, ``--true-on-policy-profile`` and
``--true-on-policy-vocab-size`` (the tokenizer's vocab size, before Megatron pads it).

``add_true_on_policy_args`` can be passed as Megatron's ``extra_args_provider``; the package also
wraps ``megatron.training.arguments.parse_args`` (when a training script imports it) so the flags
exist without any change to the script, and enables the patches once the flags are parsed.
"""
import argparse
import functools


def add_true_on_policy_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    if any("--true-on-policy" in a.option_strings for a in parser._actions):
        return parser
    group = parser.add_argument_group(title="mindspeed-tp (true on-policy)")
    group.add_argument("--true-on-policy", action="store_true",
                       help="compute logprobs bitwise equal across TP/SP/EP/PP layouts (mindspeed-tp)")
    group.add_argument("--true-on-policy-profile", default=None, metavar="PATH",
                       help="numerics profile (bundled name or YAML path); implies --true-on-policy")
    group.add_argument("--true-on-policy-vocab-size", type=int, default=None, metavar="N",
                       help="the true (unpadded) vocab size: the logprob/loss excludes the columns Megatron pads "
                            "(make_vocab_size_divisible_by x TP) exactly")
    return parser


def apply_true_on_policy_args(args) -> bool:
    """Enable the patches if the parsed args ask for it; returns whether they did."""
    profile = getattr(args, "true_on_policy_profile", None)
    if getattr(args, "true_on_policy", False) or profile:
        import mindspeed_tp

        mindspeed_tp.enable(profile)
        vocab = getattr(args, "true_on_policy_vocab_size", None)
        if vocab is not None:
            mindspeed_tp.set_vocab_size(int(vocab))
        return True
    return False


def patch_parse_args(arguments_module) -> None:
    """Wrap Megatron's ``parse_args(extra_args_provider=None, ignore_unknown_args=False)``."""
    original = arguments_module.parse_args
    if getattr(original, "_mindspeed_tp", False):
        return

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *args, **kwargs):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser) or parser
            return add_true_on_policy_args(parser)

        parsed = original(provider, *args, **kwargs)
        apply_true_on_policy_args(parsed)
        return parsed

    parse_args._mindspeed_tp = True
    arguments_module.parse_args = parse_args
