"""Stand-in for Megatron-Bridge's GPT provider (NVIDIA-NeMo/Megatron-Bridge,
``src/megatron/bridge/models/gpt_provider.py``, read at commit 067f987): Megatron-Bridge needs
Python >= 3.12 and cannot be installed on this machine's Python 3.11.

Only what mindspeed-tp's hook touches, with the published names and signatures: the module-level
spec functions (``default_layer_spec`` -> ``transformer_engine_layer_spec``, ``local_layer_spec``
-> megatron-core's ``get_gpt_layer_local_spec`` with upstream's arguments) and
``GPTModelProvider.provide(self, pre_process=None, post_process=None, vp_stage=None)``, which
resolves a callable ``transformer_layer_spec`` as upstream does (passing ``vp_stage`` when the
function takes it) and builds megatron-core's GPTModel with the provider's position encoding
(upstream's field ``position_embedding_type``, which its Qwen / Llama providers set to 'rope').

Proves: the hook's target and signature match the published source, and a provider holding the
default (Transformer Engine) spec builds a local-spec GPTModel under the patches. Does not prove:
anything of Megatron-Bridge's own configuration, weight mapping (its mapping registry already
aliases the local spec's norm names), or that no other path of the real provider builds TE modules.
"""
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel as MCoreGPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


def transformer_engine_layer_spec(config: "GPTModelProvider") -> ModuleSpec:
    return get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts,
                                                      moe_grouped_gemm=config.moe_grouped_gemm,
                                                      qk_layernorm=config.qk_layernorm)


def local_layer_spec(config: "GPTModelProvider") -> ModuleSpec:
    return get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                    qk_layernorm=config.qk_layernorm, normalization=config.normalization)


def default_layer_spec(config: "GPTModelProvider") -> ModuleSpec:
    return transformer_engine_layer_spec(config)


@dataclass
class GPTModelProvider(TransformerConfig):
    vocab_size: Optional[int] = None
    seq_length: int = 1024
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    transformer_layer_spec: Union[ModuleSpec, Callable[["GPTModelProvider"], ModuleSpec]] = default_layer_spec

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> MCoreGPTModel:
        spec = self.transformer_layer_spec
        if not isinstance(spec, ModuleSpec):
            if "vp_stage" in inspect.signature(spec).parameters:
                spec = spec(self, vp_stage=vp_stage)
            else:
                spec = spec(self)
        return MCoreGPTModel(
            self, transformer_layer_spec=spec, vocab_size=self.vocab_size, max_sequence_length=self.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage() if pre_process is None else pre_process,
            post_process=parallel_state.is_pipeline_last_stage() if post_process is None else post_process,
            position_embedding_type=self.position_embedding_type, rotary_base=self.rotary_base,
        )
