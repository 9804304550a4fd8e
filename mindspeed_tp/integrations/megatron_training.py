"""Megatron-style training-script flags: ``--true-on-policy``, ``--true-on-policy-profile`` and
``--true-on-policy-vocab-size`` (the model config's vocab_size -- the columns the rollout engine's
log-softmax spans, not len(tokenizer) -- before Megatron pads it).

``add_true_on_policy_args`` can be passed as Megatron's ``extra_args_provider``; the integration
registry also wraps ``megatron.training.arguments.parse_args`` (once a training script imports it)
so the flags exist without any change to the script, and enables the patches once they are parsed.
"""
import argparse
import functools

from .. import switch
from ..patching import Patch, PatchRegistry

PARSE_ARGS = "megatron.training.arguments:parse_args"


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
        from ..contract.profile import load_profile
        from ..contract.refusals import refuse

        prof = load_profile(profile)
        if prof.logprob_semantics not in (None, "raw"):  # nothing in Megatron-LM's loss reads it
            raise refuse("megatron_logprob_semantics", semantics=prof.logprob_semantics)
        switch.enable(prof)
        vocab = getattr(args, "true_on_policy_vocab_size", None)
        if vocab is not None:
            from .. import state

            state.set_vocab_size(int(vocab))
        return True
    return False


def wrap_parse_args(original):
    """Megatron's ``parse_args(extra_args_provider=None, ignore_unknown_args=False)`` with our flags."""

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *args, **kwargs):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser) or parser
            return add_true_on_policy_args(parser)

        parsed = original(provider, *args, **kwargs)
        apply_true_on_policy_args(parsed)
        return parsed

    return parse_args


def register(reg: PatchRegistry) -> None:
    reg.add(Patch(target=PARSE_ARGS, replacement=wrap_parse_args, wraps=True, on_import=True,
                  reason="Megatron-LM training scripts: adds --true-on-policy / --true-on-policy-profile and "
                         "enables the patches once the arguments are parsed"))
