"""Qwen3 and Qwen3-MoE (transformers' qwen3 / qwen3_moe, vLLM's qwen3.py / qwen3_moe.py): QK-norm,
no biases, plain RoPE; the MoE: softmax router, top-k renormalised by ``norm_topk_prob``, dense
layers only as a leading block."""
from __future__ import annotations

from typing import Any, Dict

from ..contract.refusals import refuse
from ..errors import ConfigError
from .common import (QWEN_EXPERT_NAMES, check_exportable, check_model_type, decoder_config, decoder_fields,
                     refuse_sliding_window, rope_fields)

NAME = "qwen3"
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
FIXED = dict(qk_layernorm=True, add_qkv_bias=False)  # what the architecture fixes (import sets, export checks)
EXPERT_NAMES = QWEN_EXPERT_NAMES


def _first_k_dense(cfg: Dict[str, Any], layers: int, where: str) -> int:
    """Qwen3-MoE places dense layers by ``mlp_only_layers`` and ``decoder_sparse_step``; the
    Megatron model here supports dense layers only as a leading block (moe_layer_freq)."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    if step != 1:
        raise refuse("hf_sparse_step", where=where, step=step)
    dense = sorted(int(i) for i in cfg.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or len(dense) >= layers:
        raise refuse("hf_dense_layers", where=where, dense=dense)
    return len(dense)


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    check_model_type(cfg, ARCHITECTURES[architecture], architecture, where)
    if cfg.get("attention_bias"):
        raise refuse("hf_attention_bias", where=where, family="Qwen3")
    refuse_sliding_window(cfg, where)
    fields = dict(decoder_fields(cfg, name, where), **rope_fields(cfg, where, scalings=("yarn",)), family=NAME, **FIXED)
    if architecture == "Qwen3MoeForCausalLM":
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not experts:
            raise ConfigError(f"{where}: Qwen3-MoE config without num_experts")
        if cfg.get("shared_expert_intermediate_size"):
            raise ConfigError(f"{where}: shared_expert_intermediate_size is not part of Qwen3-MoE and is not mapped")
        fields.update(
            num_experts=int(experts),
            moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
            moe_router_topk=int(cfg["num_experts_per_tok"]),
            moe_router_score_function="softmax",
            # Qwen3-MoE: softmax over all experts, top-k, then renormalise if norm_topk_prob.
            # Megatron: top-k of the logits then softmax over those k (the same numbers), or with
            # pre_softmax the softmax over all experts then top-k without renormalising.
            moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", False)),
            first_k_dense=_first_k_dense(cfg, fields["num_layers"], where),
        )
    return fields


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    if spec.moe_router_score_function != "softmax" or spec.moe_shared_expert_intermediate_size \
            or spec.moe_router_enable_expert_bias or spec.moe_router_topk_scaling_factor:
        raise ConfigError(f"model {spec.name}: only Qwen3 / Qwen3-MoE style models can be exported to HF format "
                          f"(softmax router, no shared expert, no expert bias, no top-k scaling)")
    check_exportable(spec, "Qwen3", FIXED, allows=("experts", "yarn"))
    arch = "Qwen3MoeForCausalLM" if spec.is_moe else "Qwen3ForCausalLM"
    cfg = decoder_config(spec, arch, ARCHITECTURES[arch], dtype)
    cfg.update(attention_bias=False, use_sliding_window=False)
    if spec.is_moe:
        cfg.update(num_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
                   num_experts_per_tok=spec.moe_router_topk, norm_topk_prob=not spec.moe_router_pre_softmax,
                   decoder_sparse_step=1, mlp_only_layers=list(range(spec.first_k_dense)))
    return cfg
