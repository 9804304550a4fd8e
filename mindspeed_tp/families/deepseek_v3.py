"""DeepSeek-V3 / R1, Kimi-K2 and Moonlight (transformers' deepseek_v3, vLLM's deepseek_v2.py): multi-latent
attention and DeepSeek-V3's MoE block. Attention: queries through a ``q_lora_rank`` latent with its
RMSNorm (Moonlight: none, one ``q_proj``), keys and values up-projected per head from the normed
``kv_lora_rank`` latent, each head's query / key ``qk_nope_head_dim`` channels without RoPE then
``qk_rope_head_dim`` with it (one rope key shared by the heads, its channels interleaved:
``rope_interleave``), values ``v_head_dim``; RoPE plain or YaRN (``rope_scaling`` / ``rope_parameters``
type yarn: factor, original context, beta_fast / beta_slow, cos and sin times the mscale ratio, the
softmax scale times the square of mscale_all_dim's). MoE from layer ``first_k_dense_replace`` on, as
GLM-4.5's (families/common.deepseek_moe_fields). The checkpoint's multi-token-prediction layers
(``num_nextn_predict_layers``) are dropped at import. Its tensors map one to one to megatron's MLA
(hf/mapping.py); the latent norms take ``rms_norm_eps`` as megatron and vLLM do (transformers fixes
them at 1e-6: Moonlight's 1e-5 differs there)."""
from __future__ import annotations

from typing import Any, Dict

from ..contract.refusals import refuse
from ..errors import ConfigError
from .common import (DEEPSEEK_EXPERT_NAMES, DEEPSEEK_ROUTER, check_exportable, decoder_config, decoder_fields,
                     deepseek_moe_config, deepseek_moe_fields, refuse_sliding_window, yarn_fields)

NAME = "deepseek_v3"
ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3"}
MODEL_TYPES = ("deepseek_v3", "kimi_k2")  # Kimi-K2 writes its own model_type for the same architecture
FIXED = dict(DEEPSEEK_ROUTER, multi_latent_attention=True, qk_layernorm=True)  # import sets, export checks
EXPERT_NAMES = DEEPSEEK_EXPERT_NAMES
MTP_LAYERS_KEY = "num_nextn_predict_layers"
# DeepSeek-V3's config.json names its router; transformers ignores these keys and always runs it,
# vLLM reads them (without them: softmax scores and no expert bias), so export writes them and
# import refuses other values.
ROUTER_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _rope(cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Plain RoPE, or YaRN with megatron's fields (common.yarn_fields); megatron's MLA always rounds
    the ramp's ends out (``truncate: false`` refused)."""
    block, key = {}, None
    for name in ("rope_parameters", "rope_scaling"):  # transformers 5 writes the first, older ones the second
        if (cfg.get(name) or {}).get("rope_type", (cfg.get(name) or {}).get("type", "default")) not in (None, "default"):
            block, key = cfg[name], name
            break
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not block:
        return dict(rope_type="rope", rotary_base=theta)
    kind = block.get("rope_type", block.get("type"))
    if kind != "yarn":
        raise refuse("hf_rope_scaling", where=where, key=key, kind=kind, supported="default, yarn")
    if block.get("truncate") is False:
        raise refuse("hf_rope_scaling", where=where, key=f"{key}.truncate", kind="yarn with truncate",
                     supported="default, yarn (megatron's YarnRotaryEmbedding)")
    return yarn_fields(cfg, block, key, theta, where)


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    if cfg.get("model_type", "deepseek_v3") not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type={cfg.get('model_type')!r} does not match architecture {architecture}")
    refuse_sliding_window(cfg, where)
    if cfg.get("attention_bias"):
        raise refuse("hf_attention_bias", where=where, family="DeepSeek-V3")
    if cfg.get("rope_interleave", True) is False:
        raise refuse("hf_rope_interleave", where=where)
    for key, value in ROUTER_KEYS.items():
        if cfg.get(key, value) != value:
            raise refuse("hf_moe_routing", where=where, key=key, value=repr(cfg[key]),
                         why=f"DeepSeek-V3's router is {key}={value!r} (transformers' deepseek_v3 runs only that one)")
    fields = dict(decoder_fields(cfg, name, where), **_rope(cfg, where), family=NAME, **FIXED)
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    q_lora = cfg.get("q_lora_rank")
    fields.update(num_query_groups=fields["num_attention_heads"], kv_channels=nope + rope, qk_head_dim=nope,
                  qk_pos_emb_head_dim=rope, v_head_dim=int(cfg["v_head_dim"]), kv_lora_rank=int(cfg["kv_lora_rank"]),
                  q_lora_rank=None if q_lora is None else int(q_lora))
    fields.update(deepseek_moe_fields(cfg, fields["num_layers"], "DeepSeek-V3", where))
    return fields


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    moe = deepseek_moe_config(spec, "DeepSeek-V3")
    check_exportable(spec, "DeepSeek-V3", FIXED, allows=("experts", "yarn"))
    cfg = decoder_config(spec, "DeepseekV3ForCausalLM", "deepseek_v3", dtype)
    del cfg["head_dim"]
    cfg.update(q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_head_dim,
               qk_rope_head_dim=spec.qk_pos_emb_head_dim, v_head_dim=spec.v_head_dim, attention_bias=False,
               rope_interleave=True, **moe, **ROUTER_KEYS)
    return cfg
