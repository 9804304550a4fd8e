"""GLM-4.5 / 4.6 (transformers' glm4_moe, vLLM's glm4_moe.py): DeepSeek-V3's MoE block on standard
attention. Attention: QKV bias (``attention_bias``), optional QK-norm (``use_qk_norm``), RoPE on the
leading ``partial_rotary_factor`` of each head (0.5). MoE from layer ``first_k_dense_replace`` on:
sigmoid scores, experts selected on score + ``e_score_correction_bias`` (the aux-loss-free bias),
the chosen unbiased scores renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``;
``n_shared_experts`` shared experts as one of ``n_shared_experts * moe_intermediate_size``.
Group-limited routing (``n_group`` / ``topk_group``; GLM's 1 / 1 selects every group) where
megatron's group score is transformers' (the top 2 experts of a group: top-k / topk_group = 2); the checkpoint's multi-token-prediction layers
(``num_nextn_predict_layers``) are not part of the next-token model and are dropped at import."""
from __future__ import annotations

from typing import Any, Dict

from .common import (DEEPSEEK_EXPERT_NAMES, DEEPSEEK_ROUTER, check_exportable, check_model_type, decoder_config,
                     decoder_fields, deepseek_moe_config, deepseek_moe_fields, refuse_sliding_window, rope_fields)

NAME = "glm4_moe"
ARCHITECTURES = {"Glm4MoeForCausalLM": "glm4_moe"}
FIXED = DEEPSEEK_ROUTER  # import sets, export checks
EXPERT_NAMES = DEEPSEEK_EXPERT_NAMES
MTP_LAYERS_KEY = "num_nextn_predict_layers"  # the checkpoint's extra layers past num_hidden_layers (dropped)


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    check_model_type(cfg, "glm4_moe", architecture, where)
    refuse_sliding_window(cfg, where)
    fields = dict(decoder_fields(cfg, name, where), **rope_fields(cfg, where, partial=True), family=NAME, **FIXED,
                  qk_layernorm=bool(cfg.get("use_qk_norm", False)), add_qkv_bias=bool(cfg.get("attention_bias")))
    fields.update(deepseek_moe_fields(cfg, fields["num_layers"], "GLM-4.5", where))
    return fields


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    moe = deepseek_moe_config(spec, "GLM-4.5")
    check_exportable(spec, "GLM-4.5", FIXED, allows=("experts", "rotary_percent"))
    cfg = decoder_config(spec, "Glm4MoeForCausalLM", "glm4_moe", dtype)
    cfg.update(attention_bias=spec.add_qkv_bias, use_qk_norm=spec.qk_layernorm, partial_rotary_factor=spec.rotary_percent,
               **moe)
    return cfg
