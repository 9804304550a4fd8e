"""verl integration (its entry point is ``mindspeed_tp.verl``: ``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl``).

verl (github.com/volcengine/verl) imports every module named in ``VERL_USE_EXTERNAL_MODULES`` when
the ``verl`` package is imported (``verl/__init__.py`` -> ``verl.utils.import_utils.
import_external_libs``): in the driver and in every Ray worker, before its Megatron workers are
built. The entry enables the patches (profile from ``MINDSPEED_TP_PROFILE``); the registry entries
here, applied as verl's modules are imported,

1. make verl build its Megatron models with megatron-core's local layer spec: verl's
   ``verl/models/mcore/model_initializer.py`` asks ``get_gpt_decoder_block_spec(config,
   use_transformer_engine=True)``, whose Transformer Engine layers (under MindSpeed: its
   ``mindspeed.te`` replacements) no mindspeed-tp patch covers;
2. route verl's Megatron logprob, ``verl.utils.megatron.tensor_parallel.
   vocab_parallel_log_probs_from_logits(logits, labels)`` -- what ``MegatronPPOActor.compute_log_prob``
   (its ``logits_processor``, after ``logits.div_(temperature)``) and the Megatron engine call --
   through mindspeed-tp's canonical vocab-tree logprob, as soon as verl imports that module (verl
   is optional: nothing is imported from it here).

On Ascend, verl's workers import ``mindspeed.megatron_adaptor`` and call MindSpeed's ``repatch()``
after the entry ran; mindspeed-tp's MindSpeed feature and its hook on the adaptor take the
patched targets back each time (``mindspeed_tp.integrations.mindspeed``).
"""
from .. import compat, state
from ..kernels import vocab_parallel_logprob
from ..patching import Patch, PatchRegistry

VERL_LOGPROB = "verl.utils.megatron.tensor_parallel:vocab_parallel_log_probs_from_logits"
VERL_BLOCK_SPEC = "verl.models.mcore.model_initializer:get_gpt_decoder_block_spec"


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


def _local_spec(original):
    def get_gpt_decoder_block_spec(config, use_transformer_engine=True, **kwargs):
        if state.enabled():
            use_transformer_engine = False
        return original(config, use_transformer_engine=use_transformer_engine, **kwargs)

    return get_gpt_decoder_block_spec


def register(reg: PatchRegistry) -> None:
    reg.add(Patch(target=VERL_LOGPROB, replacement=_verl_logprob, wraps=True, on_import=True,
                  reason="verl's Megatron actor logprob through the canonical vocab tree (fp32)"))
    # Only verl's binding: megatron-core's own get_gpt_decoder_block_spec stays untouched.
    reg.add(Patch(target=VERL_BLOCK_SPEC, replacement=_local_spec, wraps=True, on_import=True, everywhere=False,
                  reason="verl builds its Megatron models with megatron-core's local layer spec (the Transformer "
                         "Engine layers it asks for are not covered by the patches)"))
