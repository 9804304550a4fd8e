"""verl integration (its entry point is ``mindspeed_tp.verl``: ``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl``).

verl (github.com/volcengine/verl) imports every module named in ``VERL_USE_EXTERNAL_MODULES`` when
the ``verl`` package is imported (``verl/__init__.py`` -> ``verl.utils.import_utils.
import_external_libs``): in the driver and in every Ray worker, before its Megatron engine is
built. The entry enables the patches (profile from ``MINDSPEED_TP_PROFILE``); the registry entries
here, applied as verl's and mbridge's modules are imported (nothing is imported from them here):

1. verl's logprob (``verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits``,
   what ``MegatronEngineWithLMHead._lm_head_logits_processor`` calls after dividing the logits by the
   temperature in place) is the active strategy's: the canonical vocab tree, or in rollout-layout
   mode the engine's full-vocab fp32 log-softmax. verl's own version calls megatron-core's
   ``vocab_parallel_cross_entropy`` outside any model's loss, where the patch cannot learn the true
   vocab size, hence this entry: the logits carry it (``models.marks``; mbridge's models are marked
   with the Hugging Face vocab size, ``LLMBridge._model_provider``), or it is set explicitly, or the
   call is refused. verl's actor computes temperature logprobs (``logprob_semantics: temperature``); a
   profile asking for processed ones is refused (``verl_processed_logprobs``). The logits processor's
   in-place division by the temperature runs on fp32 logits (``temperature_in_fp32``: a real
   engine's bf16 logits are widened first), as the engine divides them;
2. the layer spec verl's models are built from is one the patches cover: verl 0.9 builds them
   through mbridge (``mbridge.core.llm_bridge.LLMBridge._get_transformer_layer_spec``) or, in older
   verl, ``verl/models/mcore/model_initializer.py``; both ask megatron-core's
   ``get_gpt_decoder_block_spec(config, use_transformer_engine=True, ...)``, whose Transformer
   Engine layers (under MindSpeed: its ``mindspeed.te`` replacements) no patch covers. While
   mindspeed-tp is enabled their binding builds the local spec (same parameters; ``vp_stage`` passes
   through: the wrapper keeps megatron's signature, which both inspect), and mbridge's Megatron ->
   Hugging Face name table learns the local spec's names (the norms TE fuses into the next linear;
   SequentialMLP experts, at TP = EP = expert-TP = 1 only);
3. verl's fused-kernel forward (``actor_rollout_ref.model.use_fused_kernels=True``) is refused: it
   computes logprobs in its own kernel, outside the patched vocab reduction;
4. Megatron-Bridge's ``GPTModelProvider.provide`` (verl's ``vanilla_mbridge=False`` path) builds the
   local layer spec instead of its default Transformer Engine one (its own name mapping already knows
   the local spec's names). Megatron-Bridge needs Python >= 3.12: written against its published
   source (NVIDIA-NeMo/Megatron-Bridge ``src/megatron/bridge/models/gpt_provider.py``), not run here.

On Ascend, verl's workers import ``mindspeed.megatron_adaptor`` and call MindSpeed's ``repatch()``
after the entry ran; mindspeed-tp's MindSpeed feature and its hook on the adaptor take the
patched targets back each time (``mindspeed_tp.integrations.mindspeed``).
"""
import functools
import re
import sys

import torch

from .. import compat, state
from ..contract.refusals import refuse
from ..kernels.collectives import group_size
from ..models.marks import TRUE_VOCAB_ATTR, mark_true_vocab
from ..numerics import ACTIVE
from ..numerics.vocab import true_vocab_size
from ..numerics.weight_caches import invalidating
from ..patching import Patch, PatchRegistry
from . import verl_rollout_match

VERL_LOGPROB = "verl.utils.megatron.tensor_parallel:vocab_parallel_log_probs_from_logits"
VERL_LOGITS_PROCESSOR = ("verl.workers.engine.megatron.transformer_impl:"
                         "MegatronEngineWithLMHead._lm_head_logits_processor")
VERL_BLOCK_SPEC = "verl.models.mcore.model_initializer:get_gpt_decoder_block_spec"
MBRIDGE_BLOCK_SPEC = "mbridge.core.llm_bridge:get_gpt_decoder_block_spec"
MBRIDGE_BRIDGE = "mbridge.core.bridge:Bridge"
MBRIDGE_PROVIDER = "mbridge.core.llm_bridge:LLMBridge._model_provider"
VERL_FUSED_FORWARD = "verl.models.mcore.model_forward_fused:patch_fused_forward"
MEGATRON_BRIDGE_PROVIDE = "megatron.bridge.models.gpt_provider:GPTModelProvider.provide"

_LOCAL_TO_TE_NAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
)


def _verl_logprob(original):
    """verl's vocab_parallel_log_probs_from_logits calls megatron's vocab_parallel_cross_entropy outside
    any model's loss, so it is routed here: the active strategy's logprob (the canonical vocab tree;
    in rollout-layout mode the engine's one fp32 log-softmax over the whole vocab), with the padded
    vocab columns excluded by the true vocab size -- the explicit setting, else the mark the model's
    forward put on its logits (``models.marks``: mbridge's vocab before it pads, a Megatron-Bridge
    config's ``vocab_size``); unknown: refused, naming the settings (``vocab_size_unknown``)."""

    def vocab_parallel_log_probs_from_logits(logits, labels):
        numerics = ACTIVE.current()
        if numerics is None:
            return original(logits, labels)
        if numerics.profile.logprob_semantics == "processed" and not verl_rollout_match.rollout_known():
            raise refuse("verl_processed_logprobs")  # which cut the rollout made is unknown
        group = compat.tp_group_of()
        vocab = true_vocab_size(logits.shape[-1] * group_size(group), from_model=getattr(logits, TRUE_VOCAB_ATTR, None))
        return numerics.logprob(logits, labels, group, vocab)

    return vocab_parallel_log_probs_from_logits


def temperature_in_fp32(original):
    """verl's LM-head logits processor divides the logits by the per-token fp32 temperature in place,
    in the logits' dtype; the engine divides fp32 logits (vLLM: ``logits.to(float32)``, then
    ``Sampler.apply_temperature``). Logits in another dtype (a real engine's bf16 LM head) are widened
    first -- exact -- so verl's division is the engine's; every argument is passed on as given. The true
    vocab size is the engine's Hugging Face config's (``model_config.hf_config.vocab_size``)."""

    @functools.wraps(original)
    def _lm_head_logits_processor(self, logits, *args, **kwargs):
        if not state.enabled():
            return original(self, logits, *args, **kwargs)
        if logits.dtype != torch.float32:
            logits = logits.float()
        # the processor copies the logits (entropy) and the widening above makes new ones, neither keeping the
        # model's vocab mark: the logprob learns the true vocab from the engine's Hugging Face config
        hf_config = getattr(getattr(self, "model_config", None), "hf_config", None)
        with state.model_vocab_size(getattr(hf_config, "vocab_size", None)):
            return original(self, logits, *args, **kwargs)

    return _lm_head_logits_processor


def mbridge_true_vocab(original):
    """LLMBridge._model_provider: every GPTModel it builds is marked with the Hugging Face vocab size
    (mbridge pads the model's vocab to ``make_vocab_size_divisible_by``)."""

    @functools.wraps(original)
    def _model_provider(self, post_model_creation_callbacks):
        def mark(model, pre_process, post_process, config, hf_config):
            mark_true_vocab(model, int(hf_config.vocab_size))

        return original(self, [mark, *post_model_creation_callbacks])

    return _model_provider


def _local_spec() -> bool:
    """The local layer spec: while mindspeed-tp is enabled, and in a CPU run of verl without Transformer
    Engine (``mindspeed_tp.verl_cpu``: there is no other spec to build, the vanilla arm included)."""
    from .verl_cpu import local_spec_needed

    return state.enabled() or local_spec_needed()


def local_decoder_block_spec(original):
    """get_gpt_decoder_block_spec asking for the local spec while mindspeed-tp is enabled (or on a CPU
    without Transformer Engine); the original's signature (``vp_stage`` and all) is what callers inspect
    and what is passed on."""

    @functools.wraps(original)
    def get_gpt_decoder_block_spec(config, use_transformer_engine=True, *args, **kwargs):
        if _local_spec():
            use_transformer_engine = False
        return original(config, use_transformer_engine, *args, **kwargs)

    return get_gpt_decoder_block_spec


def mbridge_local_names(original):
    """Bridge._weight_name_mapping_mcore_to_hf also for the local spec's norm names."""

    @functools.wraps(original)
    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name):
        try:
            return original(self, mcore_weights_name)
        except NotImplementedError:
            for local, te in _LOCAL_TO_TE_NAMES:
                if mcore_weights_name.endswith(local):
                    return original(self, mcore_weights_name[: -len(local)] + te)
            raise

    return _weight_name_mapping_mcore_to_hf


_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def mbridge_local_experts(original):
    """Bridge._weight_name_mapping_mcore_local_to_global also for SequentialMLP experts (the local
    spec's): mbridge names experts as the grouped-GEMM module does (``experts.linear_fc1.weight<id>``,
    global ids), so each ``local_experts.<j>`` gets that name. mbridge splits and scatters expert
    tensors by those grouped names only, so beyond TP = EP = expert-TP = 1 this is refused."""

    @functools.wraps(original)
    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep=True):
        names = original(self, model, consider_ep)
        if not any(_LOCAL_EXPERT.match(v) for v in names.values()):
            return names
        sizes = {"tensor_model_parallel_size": self.mpu.tp_size, "expert_model_parallel_size": self.mpu.ep_size,
                 "expert_tensor_parallel_size": self.mpu.etp_size}
        if any((size or 1) > 1 for size in sizes.values()):
            raise refuse("mbridge_local_experts_parallel", sizes=sizes)
        for key, value in names.items():
            match = _LOCAL_EXPERT.match(value)
            if match:
                names[key] = f"{match.group(1)}.{match.group(3)}.weight{int(match.group(2))}"
        return names

    return _weight_name_mapping_mcore_local_to_global


def refuse_fused_forward(original):
    @functools.wraps(original)
    def patch_fused_forward(*args, **kwargs):
        if state.enabled():
            raise refuse("verl_fused_kernels")
        return original(*args, **kwargs)

    return patch_fused_forward


def local_spec_provider(original):
    """GPTModelProvider.provide with the local layer spec while mindspeed-tp is enabled, when the
    provider holds Megatron-Bridge's default (Transformer Engine) spec function; any other spec is
    left as given (the GPTModel guard refuses uncovered modules by name)."""

    gpt_provider = sys.modules[original.__module__]  # megatron.bridge.models.gpt_provider, imported by now

    @functools.wraps(original)
    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        te_specs = tuple(getattr(gpt_provider, n, None) for n in ("default_layer_spec", "transformer_engine_layer_spec"))
        if _local_spec() and self.transformer_layer_spec in te_specs:
            self.transformer_layer_spec = gpt_provider.local_layer_spec
        return original(self, pre_process, post_process, vp_stage)

    return provide


def register(reg: PatchRegistry) -> None:
    verl_rollout_match.register(reg)
    spec_reason = ("builds the local layer spec while mindspeed-tp is enabled (the Transformer Engine layers it asks "
                   "for are not covered by the patches); megatron's signature (vp_stage) kept")
    reg.add(Patch(target=VERL_LOGPROB, replacement=_verl_logprob, wraps=True, on_import=True,
                  reason="verl's Megatron logprob by the active strategy (canonical vocab tree, or the engine's "
                         "full-vocab fp32 log-softmax), padded columns excluded by the true vocab size its logits carry"))
    reg.add(Patch(target=VERL_LOGITS_PROCESSOR, replacement=temperature_in_fp32, wraps=True, on_import=True,
                  reason="verl's temperature division (in place, in the logits' dtype) on fp32 logits, as the "
                         "engine divides them"))
    reg.add(Patch(target=MBRIDGE_PROVIDER, replacement=mbridge_true_vocab, wraps=True, on_import=True,
                  reason="mbridge's models carry the Hugging Face vocab size (mbridge pads the model's vocab)"))
    reg.add(Patch(target=f"{MBRIDGE_BRIDGE}.load_weights", replacement=invalidating, wraps=True, on_import=True,
                  reason="the re-laid and prepacked weight caches are invalidated after mbridge loads weights"))
    # Only the importer's binding: megatron-core's own get_gpt_decoder_block_spec stays untouched.
    reg.add(Patch(target=VERL_BLOCK_SPEC, replacement=local_decoder_block_spec, wraps=True, on_import=True,
                  everywhere=False, reason="verl's model initializer " + spec_reason))
    reg.add(Patch(target=MBRIDGE_BLOCK_SPEC, replacement=local_decoder_block_spec, wraps=True, on_import=True,
                  everywhere=False, reason="mbridge's LLMBridge " + spec_reason))
    reg.add(Patch(target=f"{MBRIDGE_BRIDGE}._weight_name_mapping_mcore_to_hf", replacement=mbridge_local_names,
                  wraps=True, on_import=True,
                  reason="mbridge's Megatron -> HF names know the TE spec's fused norms; the local spec's norms are "
                         "the same tensors under input_layernorm / pre_mlp_layernorm"))
    reg.add(Patch(target=f"{MBRIDGE_BRIDGE}._weight_name_mapping_mcore_local_to_global",
                  replacement=mbridge_local_experts, wraps=True, on_import=True,
                  reason="mbridge names MoE experts as grouped-GEMM experts; the local spec's SequentialMLP experts "
                         "get those names (TP = EP = expert-TP = 1; refused beyond)"))
    reg.add(Patch(target=VERL_FUSED_FORWARD, replacement=refuse_fused_forward, wraps=True, on_import=True,
                  reason="verl's fused-kernel forward (use_fused_kernels=True) is refused by name"))
    reg.add(Patch(target=MEGATRON_BRIDGE_PROVIDE, replacement=local_spec_provider, wraps=True, on_import=True,
                  reason="Megatron-Bridge's GPT provider builds the local layer spec instead of its default "
                         "Transformer Engine one while mindspeed-tp is enabled"))
