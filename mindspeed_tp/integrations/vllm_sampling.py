"""vLLM's ``SamplingParams``, checked as it is built in every process where mindspeed-tp is enabled
(verl's vLLM server imports ``mindspeed_tp.verl`` through ``VERL_USE_EXTERNAL_MODULES``; a script
that enables it before building its requests): a field whose logits processor training never
models is refused by name (``contract/sampling_params.py``). vLLM's ``__post_init__`` normalises
the fields and then calls ``_verify_args``, which is looked up on the class at each construction
(the msgspec Struct's ``__post_init__`` itself is bound when the class is made), so the check wraps
``_verify_args``: after vLLM's own validation, on the normalised fields."""
import functools

from .. import state
from ..contract.sampling_params import check_sampling_params
from ..patching import Patch, PatchRegistry

TARGET = "vllm.sampling_params:SamplingParams._verify_args"


def checked_verify_args(original):
    @functools.wraps(original)
    def _verify_args(self):
        original(self)
        if state.enabled():
            check_sampling_params(self)

    return _verify_args


def register(reg: PatchRegistry) -> None:
    reg.add(Patch(target=TARGET, replacement=checked_verify_args, wraps=True, on_import=True,
                  reason="refuses, by name, the sampling fields whose logits processors training never models "
                         "(penalties, min_p, logit_bias, bad / allowed words, guided decoding, ...)"))
