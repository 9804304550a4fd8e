"""verl entry point: ``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl``.

verl (github.com/volcengine/verl) imports every module named in ``VERL_USE_EXTERNAL_MODULES`` when
the ``verl`` package is imported (``verl/__init__.py`` -> ``verl.utils.import_utils.
import_external_libs``): in the driver and in every Ray worker, before its Megatron engine is
built. Importing this module

1. enables the patches (profile from ``MINDSPEED_TP_PROFILE``, default ``default``). verl's Megatron
   logprob (``verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits``, what
   ``MegatronEngineWithLMHead._lm_head_logits_processor`` calls after dividing the logits by the
   temperature) is ``-megatron.core.tensor_parallel.vocab_parallel_cross_entropy``, which the patch
   set replaces -- in either profile (canonical tree, or rollout layout's full-vocab log-softmax) --
   so nothing of verl's logprob is overridden here;
2. makes the layer spec verl's models are built from one the patches cover: verl 0.9 builds them
   through mbridge (``mbridge.core.llm_bridge.LLMBridge._get_transformer_layer_spec``) or, in older
   verl, ``verl/models/mcore/model_initializer.py``; both ask megatron-core's
   ``get_gpt_decoder_block_spec(config, use_transformer_engine=True, ...)``, whose Transformer Engine
   layers (under MindSpeed: its ``mindspeed.te`` replacements) no patch covers. While mindspeed-tp is
   enabled the local spec is built instead (same parameters; verl's and mbridge's ``vp_stage``
   passes through: the wrapper keeps the original's signature), and mbridge's Megatron -> Hugging
   Face name table learns the local spec's two norm names (TE fuses them into the following linear);
3. refuses verl's fused-kernel forward (``actor_rollout_ref.model.use_fused_kernels=True``): it
   computes logprobs in its own kernel, outside the patched vocab reduction.

Megatron-Bridge (verl's other bridge, ``vanilla_mbridge=False``) asks for its layer spec through
``megatron.bridge.models.gpt_provider``; see ``MEGATRON_BRIDGE_SPEC`` below.

On Ascend, verl's workers import ``mindspeed.megatron_adaptor`` and call MindSpeed's ``repatch()``
after this module ran; mindspeed-tp's MindSpeed feature and its hook on the adaptor take the
patched targets back each time (``mindspeed_tp.mindspeed_compat``).
"""
import functools
import os
import re

import mindspeed_tp
import mindspeed_tp_autoload
from mindspeed_tp import state
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.patching import PatchRegistry

VERL_MODEL_INITIALIZER = "verl.models.mcore.model_initializer"
VERL_FUSED_FORWARD = "verl.models.mcore.model_forward_fused"
MBRIDGE_LLM = "mbridge.core.llm_bridge"
MBRIDGE_BRIDGE = "mbridge.core.bridge"
# Megatron-Bridge's GPT provider (Python >= 3.12, not installable here): its default
# transformer_layer_spec is a function of the provider choosing TE or local modules.
MEGATRON_BRIDGE_SPEC = "megatron.bridge.models.gpt_provider"

# Local-spec parameter names whose Transformer Engine spec counterpart fuses the norm into the
# next linear (TELayerNormColumnParallelLinear): same tensor, another name.
_LOCAL_TO_TE_NAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
)


def local_decoder_block_spec(original):
    """get_gpt_decoder_block_spec asking for the local spec while mindspeed-tp is enabled; the
    original's signature (``vp_stage`` and all) is what callers inspect and what is passed on."""

    @functools.wraps(original)
    def get_gpt_decoder_block_spec(config, use_transformer_engine=True, *args, **kwargs):
        if state.enabled():
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
            raise ConfigError(
                f"mbridge with the local spec's SequentialMLP experts ({sizes}): mbridge splits and scatters expert "
                f"weights by its grouped-GEMM names only, so with mindspeed-tp it loads MoE checkpoints at "
                f"tensor/expert/expert-tensor parallel size 1 only; load them with mindspeed_tp.hf instead"
            )
        for key, value in names.items():
            match = _LOCAL_EXPERT.match(value)
            if match:
                names[key] = f"{match.group(1)}.{match.group(3)}.weight{int(match.group(2))}"
        return names

    return _weight_name_mapping_mcore_local_to_global


def refuse_fused_forward(original):
    @functools.wraps(original)
    def refuse(*args, **kwargs):
        if state.enabled():
            raise ConfigError(
                "actor_rollout_ref.model.use_fused_kernels=True (also ref.*/critic.*): verl's fused logprob kernel "
                "bypasses mindspeed-tp's vocab reduction; set use_fused_kernels=False"
            )
        return original(*args, **kwargs)

    return refuse


_SPEC_REASON = ("verl/mbridge build models from megatron's get_gpt_decoder_block_spec(use_transformer_engine=True); "
                "while mindspeed-tp is enabled every importer of it by name gets the local spec (TE is not covered)")
# One registry per verl/mbridge module, applied right after that module executes (so code importing
# from it already gets ours); nothing here imports verl or mbridge itself.
_registries = {name: PatchRegistry(f"mindspeed-tp-verl:{name}")
               for name in (VERL_MODEL_INITIALIZER, MBRIDGE_LLM, MBRIDGE_BRIDGE, VERL_FUSED_FORWARD)}
_registries[VERL_MODEL_INITIALIZER].register(f"{VERL_MODEL_INITIALIZER}:get_gpt_decoder_block_spec", _SPEC_REASON,
                                             wraps=True)(local_decoder_block_spec)
_registries[MBRIDGE_LLM].register(f"{MBRIDGE_LLM}:get_gpt_decoder_block_spec", _SPEC_REASON,
                                  wraps=True)(local_decoder_block_spec)
_registries[MBRIDGE_BRIDGE].register(
    f"{MBRIDGE_BRIDGE}:Bridge._weight_name_mapping_mcore_to_hf",
    "mbridge's Megatron -> HF name table knows the TE spec's fused norm names; the local spec's norms are the same "
    "tensors under input_layernorm / pre_mlp_layernorm", wraps=True)(mbridge_local_names)
_registries[MBRIDGE_BRIDGE].register(
    f"{MBRIDGE_BRIDGE}:Bridge._weight_name_mapping_mcore_local_to_global",
    "mbridge names MoE experts as grouped-GEMM experts; the local spec's SequentialMLP experts get those names",
    wraps=True)(mbridge_local_experts)
_registries[VERL_FUSED_FORWARD].register(f"{VERL_FUSED_FORWARD}:patch_fused_forward",
                                         "verl's fused-kernel forward (use_fused_kernels=True) is refused by name",
                                         wraps=True)(refuse_fused_forward)


def verl_registries():
    """module name -> its PatchRegistry (applied once that module is imported)."""
    return dict(_registries)


def _apply(module) -> None:
    _registries[module.__name__].apply()


mindspeed_tp.enable(os.environ.get("MINDSPEED_TP_PROFILE") or None)
for _name in _registries:
    mindspeed_tp_autoload.when_imported(_name, _apply)
