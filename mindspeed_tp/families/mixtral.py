"""Mixtral 8x7B / 8x22B (transformers' mixtral, vLLM's mixtral.py): Mistral's attention (no QK-norm,
no biases, plain RoPE, an optional every-layer ``sliding_window``) with an MoE block in every layer:
softmax over all experts, top-k, renormalised over the k (Megatron's top-k then softmax: the same
numbers), no shared expert. The checkpoint keeps the block as ``block_sparse_moe`` with experts
``w1`` (gate), ``w3`` (up) and ``w2`` (down); ``intermediate_size`` is an expert's."""
from __future__ import annotations

from typing import Any, Dict

from ..contract.refusals import refuse
from ..errors import ConfigError
from .common import (ExpertNames, check_exportable, check_model_type, check_moe_exportable, decoder_config,
                     decoder_fields, refuse_sliding_window, rope_fields)

NAME = "mixtral"
ARCHITECTURES = {"MixtralForCausalLM": "mixtral"}
FIXED = dict(qk_layernorm=False, add_qkv_bias=False, moe_router_score_function="softmax",
             moe_router_pre_softmax=False, first_k_dense=0)  # import sets, export checks
EXPERT_NAMES = ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", "w1.weight",
                           "w3.weight", "w2.weight")


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    check_model_type(cfg, "mixtral", architecture, where)
    if cfg.get("attention_bias"):
        raise refuse("hf_attention_bias", where=where, family="Mixtral")
    if float(cfg.get("router_jitter_noise") or 0.0) != 0.0:
        # transformers multiplies the router input by uniform noise while training: not a function of the weights
        raise refuse("hf_router_jitter", where=where, value=cfg.get("router_jitter_noise"))
    refuse_sliding_window(cfg, where, every_layer=True)
    experts = cfg.get("num_local_experts")
    if not experts:
        raise ConfigError(f"{where}: Mixtral config without num_local_experts")
    window = cfg.get("sliding_window")
    fields = dict(decoder_fields(cfg, name, where), **rope_fields(cfg, where), family=NAME, **FIXED,
                  sliding_window=None if window is None else int(window))
    fields.update(num_experts=int(experts), moe_ffn_hidden_size=fields["ffn_hidden_size"],
                  moe_router_topk=int(cfg["num_experts_per_tok"]))
    return fields


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    check_moe_exportable(spec, "Mixtral")
    check_exportable(spec, "Mixtral", FIXED, allows=("experts", "sliding_window"))
    cfg = decoder_config(spec, "MixtralForCausalLM", "mixtral", dtype)
    cfg.update(intermediate_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size, num_local_experts=spec.num_experts,
               num_experts_per_tok=spec.moe_router_topk, sliding_window=spec.sliding_window, router_jitter_noise=0.0)
    return cfg
