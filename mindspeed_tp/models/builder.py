"""Build a megatron-core GPTModel (local spec) for the current parallel state from a ModelSpec."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..profile import Profile
from .layout import Layout
from .spec import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def transformer_config(spec: ModelSpec, layout: Layout, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        sequence_parallel=layout.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
    )


def build_gpt_stage(spec: ModelSpec, layout: Layout, dtype: torch.dtype, profile: Profile):
    """The GPTModel chunk this rank holds (pre/post-process by pipeline stage), in eval mode."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(spec, layout, dtype)
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab(profile),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rotary_base),
    )
    model.to(dtype)
    model.eval()
    return model
