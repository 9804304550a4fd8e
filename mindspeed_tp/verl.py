"""verl entry point: ``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl``.

verl (github.com/volcengine/verl) imports every module named in ``VERL_USE_EXTERNAL_MODULES`` when
the ``verl`` package is imported (``verl/__init__.py`` -> ``verl.utils.import_utils.
import_external_libs``): in the driver and in every Ray worker, before its Megatron workers are
built. Importing this module

1. enables the patches (profile from ``MINDSPEED_TP_PROFILE``, default ``default``);
2. makes verl build its Megatron models with megatron-core's local layer spec: verl's
   ``verl/models/mcore/model_initializer.py`` asks ``get_gpt_decoder_block_spec(config,
   use_transformer_engine=True)``, whose Transformer Engine layers (under MindSpeed: its
   ``mindspeed.te`` replacements) no mindspeed-tp patch covers;
3. routes verl's Megatron logprob, ``verl.utils.megatron.tensor_parallel.
   vocab_parallel_log_probs_from_logits(logits, labels)`` -- what ``MegatronPPOActor.compute_log_prob``
   (its ``logits_processor``, after ``logits.div_(temperature)``) and the Megatron engine call --
   through mindspeed-tp's canonical vocab-tree logprob, as soon as verl imports that module (verl
   is optional: nothing is imported from it here).

On Ascend, verl's workers import ``mindspeed.megatron_adaptor`` and call MindSpeed's ``repatch()``
after this module ran; mindspeed-tp's MindSpeed feature and its hook on the adaptor take the
patched targets back each time (``mindspeed_tp.mindspeed_compat``).
"""
import os

import mindspeed_tp
import mindspeed_tp_autoload
from mindspeed_tp import compat, state
from mindspeed_tp.kernels import vocab_parallel_logprob
from mindspeed_tp.patching import PatchRegistry

VERL_LOGPROB = "verl.utils.megatron.tensor_parallel:vocab_parallel_log_probs_from_logits"
VERL_MODEL_INITIALIZER = "verl.models.mcore.model_initializer"

_verl_patches = PatchRegistry("mindspeed-tp-verl")


@_verl_patches.register(VERL_LOGPROB, "verl's Megatron actor logprob through the canonical vocab tree (fp32)",
                        wraps=True)
def _verl_logprob(original):
    def vocab_parallel_log_probs_from_logits(logits, labels):
        """log softmax(logits)[labels] over the vocab-parallel logits (verl divided them by the
        temperature already); verl's own path once mindspeed_tp.disable() was called."""
        if not state.enabled():
            return original(logits, labels)
        prof = state.profile()
        return vocab_parallel_logprob(logits, labels, compat.tp_group_of(), prof.canonical_shards,
                                      pad_multiple=prof.vocab_pad_multiple)

    return vocab_parallel_log_probs_from_logits


def _patch_verl(_module) -> None:
    # Applied right after verl.utils.megatron.tensor_parallel executes, so the actor's
    # ``from ... import vocab_parallel_log_probs_from_logits`` already gets ours.
    _verl_patches.apply()


def _local_spec(module) -> None:
    """Rebind the name in verl's model initializer only (megatron's own function is untouched);
    the wrapper is a no-op once mindspeed_tp.disable() was called."""
    original = module.get_gpt_decoder_block_spec
    if getattr(original, "_mindspeed_tp", False):
        return

    def get_gpt_decoder_block_spec(config, use_transformer_engine=True, **kwargs):
        if state.enabled():
            use_transformer_engine = False
        return original(config, use_transformer_engine=use_transformer_engine, **kwargs)

    get_gpt_decoder_block_spec._mindspeed_tp = True
    module.get_gpt_decoder_block_spec = get_gpt_decoder_block_spec


def verl_registry() -> PatchRegistry:
    return _verl_patches


mindspeed_tp.enable(os.environ.get("MINDSPEED_TP_PROFILE") or None)
mindspeed_tp_autoload.when_imported(VERL_LOGPROB.partition(":")[0], _patch_verl)
mindspeed_tp_autoload.when_imported(VERL_MODEL_INITIALIZER, _local_spec)
