"""ModelSpec from a Hugging Face ``config.json`` (Qwen3 and Qwen3-MoE), and back."""
from __future__ import annotations

import json
import os
from typing import Any, Dict

from ..contract.refusals import refuse
from ..errors import ConfigError
from ..models.spec import ModelSpec

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}


def read_hf_config(directory: str) -> Dict[str, Any]:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--hf-checkpoint {directory!r}: no config.json (expected a Hugging Face model directory)")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc


def _rope_theta(cfg: Dict[str, Any], where: str) -> float:
    """Plain RoPE only: transformers 5 writes ``rope_parameters``, older ones ``rope_theta`` and
    ``rope_scaling``; any scaling (yarn, dynamic, linear...) would change the angles."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for block, key in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind not in (None, "default"):
            raise refuse("hf_rope_scaling", where=where, key=key, kind=kind)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConfigError(f"{where}: rope_theta={theta} must be an integer (Megatron's rotary_base is an int)")
    return float(theta)


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


def spec_from_hf_config(cfg: Dict[str, Any], name: str, where: str = "config.json") -> ModelSpec:
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise refuse("hf_architecture", where=where, archs=archs, supported=sorted(ARCHITECTURES))
    arch = ARCHITECTURES[archs[0]]
    if cfg.get("model_type", arch) != arch:
        raise ConfigError(f"{where}: model_type={cfg.get('model_type')!r} does not match architecture {archs[0]}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hf_hidden_act", where=where, act=cfg.get("hidden_act"))
    if cfg.get("attention_bias"):
        raise refuse("hf_attention_bias", where=where)
    sliding = cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or [])
    if sliding:
        raise refuse("hf_sliding_window", where=where)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    fields = dict(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        kv_channels=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rotary_base=_rope_theta(cfg, where),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_layernorm=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if arch == "qwen3_moe":
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
            first_k_dense=_first_k_dense(cfg, layers, where),
        )
    return ModelSpec(**fields)


def hf_config_from_spec(spec: ModelSpec, dtype: str = "bfloat16") -> Dict[str, Any]:
    """A config.json for exporting a model defined by a ModelSpec (inverse of spec_from_hf_config)."""
    if spec.moe_router_score_function != "softmax" or spec.moe_shared_expert_intermediate_size \
            or spec.moe_router_enable_expert_bias or spec.moe_router_topk_scaling_factor:
        raise ConfigError(f"model {spec.name}: only Qwen3 / Qwen3-MoE style models can be exported to HF format "
                          f"(softmax router, no shared expert, no expert bias, no top-k scaling)")
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if spec.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if spec.is_moe else "qwen3",
        "hidden_act": "silu",
        "attention_bias": False,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.kv_channels,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rotary_base,
        "rms_norm_eps": spec.norm_epsilon,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_sliding_window": False,
        "torch_dtype": dtype,
    }
    if spec.is_moe:
        cfg.update(num_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
                   num_experts_per_tok=spec.moe_router_topk, norm_topk_prob=not spec.moe_router_pre_softmax,
                   decoder_sparse_step=1, mlp_only_layers=list(range(spec.first_k_dense)))
    return cfg
