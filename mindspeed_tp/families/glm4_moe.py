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

from ..contract.refusals import refuse
from ..errors import ConfigError
from .common import (DEEPSEEK_EXPERT_NAMES, check_exportable, check_model_type, decoder_config, decoder_fields,
                     refuse_sliding_window, rope_fields)

NAME = "glm4_moe"
ARCHITECTURES = {"Glm4MoeForCausalLM": "glm4_moe"}
FIXED = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
             moe_router_pre_softmax=False)  # import sets, export checks
EXPERT_NAMES = DEEPSEEK_EXPERT_NAMES
MTP_LAYERS_KEY = "num_nextn_predict_layers"  # the checkpoint's extra layers past num_hidden_layers (dropped)


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    check_model_type(cfg, "glm4_moe", architecture, where)
    refuse_sliding_window(cfg, where)
    if not cfg.get("norm_topk_prob", True):
        # megatron's sigmoid router always renormalises the chosen scores (k > 1)
        raise refuse("hf_moe_routing", where=where, key="norm_topk_prob", value="false",
                     why="megatron's sigmoid router renormalises the top-k scores")
    groups, top_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    topk = int(cfg["num_experts_per_tok"])
    limited = top_groups < groups
    if limited and (topk % top_groups or topk // top_groups != 2):
        # transformers scores a group by its top 2 experts; megatron by its top (top-k / group_topk)
        raise refuse("hf_moe_routing", where=where, key="n_group / topk_group", value=f"{groups} / {top_groups}",
                     why=f"megatron scores a group by its top num_experts_per_tok / topk_group = {topk} / {top_groups} "
                         f"experts, transformers by its top 2: they agree only where that quotient is 2")
    fields = dict(decoder_fields(cfg, name, where), **rope_fields(cfg, where, partial=True), family=NAME, **FIXED,
                  qk_layernorm=bool(cfg.get("use_qk_norm", False)), add_qkv_bias=bool(cfg.get("attention_bias")))
    moe = int(cfg["moe_intermediate_size"])
    scaling = float(cfg.get("routed_scaling_factor", 1.0))
    dense = int(cfg.get("first_k_dense_replace", 0))
    if dense >= fields["num_layers"]:
        raise ConfigError(f"{where}: first_k_dense_replace={dense} must be below num_hidden_layers="
                          f"{fields['num_layers']} (a GLM-4.5 model has MoE layers)")
    fields.update(num_experts=int(cfg["n_routed_experts"]), moe_ffn_hidden_size=moe, moe_router_topk=topk,
                  moe_router_num_groups=groups if limited else None,
                  moe_router_group_topk=top_groups if limited else None,
                  moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                  moe_shared_expert_intermediate_size=int(cfg.get("n_shared_experts") or 0) * moe or None,
                  first_k_dense=dense)
    return fields


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    if not spec.is_moe:
        raise ConfigError(f"model {spec.name}: a GLM-4.5 checkpoint has MoE layers; set num_experts or another family")
    shared, moe = spec.moe_shared_expert_intermediate_size or 0, spec.moe_ffn_hidden_size or spec.ffn_hidden_size
    if shared % moe:
        raise ConfigError(f"model {spec.name}: moe_shared_expert_intermediate_size={shared} cannot be written as a "
                          f"GLM-4.5 checkpoint (n_shared_experts * moe_intermediate_size={moe})")
    check_exportable(spec, "GLM-4.5", FIXED, allows=("experts", "rotary_percent"))
    cfg = decoder_config(spec, "Glm4MoeForCausalLM", "glm4_moe", dtype)
    cfg.update(attention_bias=spec.add_qkv_bias, use_qk_norm=spec.qk_layernorm, partial_rotary_factor=spec.rotary_percent,
               moe_intermediate_size=moe, n_routed_experts=spec.num_experts, num_experts_per_tok=spec.moe_router_topk,
               n_shared_experts=shared // moe, first_k_dense_replace=spec.first_k_dense, norm_topk_prob=True,
               routed_scaling_factor=spec.moe_router_topk_scaling_factor or 1.0,
               n_group=spec.moe_router_num_groups or 1, topk_group=spec.moe_router_group_topk or 1,
               num_nextn_predict_layers=0)
    return cfg
