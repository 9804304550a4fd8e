"""What the families' Hugging Face configs share: the decoder's sizes, plain or Llama-3-scaled RoPE,
and the refusals of what no family here maps (another activation, sliding windows, other RoPE
scalings)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..contract.refusals import refuse
from ..errors import ConfigError

# Megatron's Llama-3 RoPE scaling (RotaryEmbedding._apply_scaling): only the factor is a GPTModel
# argument, the rest are fixed there.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def decoder_fields(cfg: Dict[str, Any], name: str, where: str) -> Dict[str, Any]:
    """The ModelSpec fields every family's config.json states alike."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hf_hidden_act", where=where, act=cfg.get("hidden_act"))
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return dict(
        name=name,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        kv_channels=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def rope_fields(cfg: Dict[str, Any], where: str, scalings: Tuple[str, ...] = (), partial: bool = False) -> Dict[str, Any]:
    """``rotary_base``, ``rotary_percent`` (``partial_rotary_factor``, where the family rotates part of
    each head: ``partial``; refused by name elsewhere) and, for rope_type ``llama3`` when the family
    allows it, ``rope_scaling_factor``; any other scaling (linear, dynamic, yarn, longrope, ...)
    changes the angles and is refused by name."""
    factor, yarn = None, None
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5 writes the first, older ones the second
        block = cfg.get(key) or {}
        kind = block.get("rope_type", block.get("type", "default"))
        if kind in (None, "default"):
            continue
        if kind not in scalings:
            raise refuse("hf_rope_scaling", where=where, key=key, kind=kind,
                         supported=", ".join(("default",) + scalings))
        if kind == "yarn":
            yarn = (block, key)
            continue
        for param, fixed in LLAMA3_FIXED.items():
            if float(block.get(param, fixed)) != fixed:
                raise refuse("hf_rope_llama3", where=where, key=f"{key}.{param}", value=block.get(param), fixed=fixed)
        if "factor" not in block:
            raise ConfigError(f"{where}: {key}.rope_type={kind!r} without its factor")
        factor = float(block["factor"])
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConfigError(f"{where}: rope_theta={theta} must be an integer (Megatron's rotary_base is an int)")
    share = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if share != 1.0 and not partial:
        raise refuse("hf_partial_rotary", where=where, value=share)
    if yarn is not None:
        return dict(yarn_fields(cfg, yarn[0], yarn[1], float(theta), where), rotary_percent=share)
    return {"rotary_base": float(theta), "rope_scaling_factor": factor, "rotary_percent": share}


def yarn_fields(cfg: Dict[str, Any], block: Dict[str, Any], key: str, theta: float, where: str) -> Dict[str, Any]:
    """A ``rope_type: yarn`` block as the ModelSpec's YaRN fields (megatron's YarnRotaryEmbedding:
    its mscale ratio equals transformers' attention factor for the combinations mapped here;
    ``truncate`` is megatron's correction_range_round_to_int)."""
    if "attention_factor" in block:  # megatron's YaRN derives the factor
        raise refuse("hf_rope_scaling", where=where, key=f"{key}.attention_factor", kind="yarn with attention_factor",
                     supported="default, yarn (megatron's YarnRotaryEmbedding)")
    # transformers' order: the config's own original_max_position_embeddings (Phi-3, DeepSeek), the
    # block's, the context length
    original = (cfg.get("original_max_position_embeddings") or block.get("original_max_position_embeddings")
                or cfg.get("max_position_embeddings"))
    if block.get("factor") is None or not original:
        raise ConfigError(f"{where}: {key}.rope_type yarn needs its factor and original_max_position_embeddings")
    mscale, all_dim = float(block.get("mscale") or 0.0), float(block.get("mscale_all_dim") or 0.0)
    if all_dim and not mscale:
        # transformers then scales cos / sin by YaRN's default concentration, megatron by 1 / mscale_all_dim's
        raise refuse("hf_rope_scaling", where=where, key=f"{key}.mscale", kind="yarn with mscale_all_dim but no mscale",
                     supported="default, yarn with both mscale and mscale_all_dim, or neither")
    return dict(rope_type="yarn", rotary_base=theta, rotary_scaling_factor=float(block["factor"]),
                original_max_position_embeddings=int(original),
                beta_fast=float(block.get("beta_fast") or 32.0), beta_slow=float(block.get("beta_slow") or 1.0),
                mscale=mscale if all_dim else 1.0, mscale_all_dim=all_dim,
                correction_range_round_to_int=block.get("truncate", True) is not False)


def yarn_config(spec, family: str) -> Dict[str, Any]:
    """The ``rope_scaling`` block of a YaRN spec (the inverse of ``yarn_fields``)."""
    block = {"rope_type": "yarn", "factor": spec.rotary_scaling_factor,
             "original_max_position_embeddings": spec.original_max_position_embeddings,
             "beta_fast": spec.beta_fast, "beta_slow": spec.beta_slow}
    if not spec.correction_range_round_to_int:
        block["truncate"] = False
    if spec.mscale_all_dim:
        block.update(mscale=spec.mscale, mscale_all_dim=spec.mscale_all_dim)
    elif spec.mscale != 1.0:
        raise ConfigError(f"model {spec.name}: mscale={spec.mscale} without mscale_all_dim cannot be written as a "
                          f"{family} checkpoint (transformers reads mscale only with mscale_all_dim)")
    return block


def refuse_sliding_window(cfg: Dict[str, Any], where: str, every_layer: bool = False) -> None:
    """Sliding windows are refused; with ``every_layer`` (Mistral's ``sliding_window``) only windows
    that alternate with full layers (``layer_types``)."""
    alternating = any(t != "full_attention" for t in cfg.get("layer_types") or [])
    if alternating or (cfg.get("use_sliding_window") and not every_layer):
        raise refuse("hf_sliding_window", where=where)


def check_model_type(cfg: Dict[str, Any], model_type: str, architecture: str, where: str) -> None:
    if cfg.get("model_type", model_type) != model_type:
        raise ConfigError(f"{where}: model_type={cfg.get('model_type')!r} does not match architecture {architecture}")


def decoder_config(spec, architecture: str, model_type: str, dtype: str) -> Dict[str, Any]:
    """config.json fields every family writes alike (inverse of ``decoder_fields`` and ``rope_fields``)."""
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_act": "silu",
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
        "torch_dtype": dtype,
    }
    if spec.rope_scaling_factor is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": spec.rope_scaling_factor, **LLAMA3_FIXED}
    if spec.rope_type == "yarn":  # a family whose check_exportable allows it (Qwen2.5 / Qwen3 long context, DeepSeek)
        cfg["rope_scaling"] = yarn_config(spec, architecture)
    return cfg


# The spec features a family's config.json may or may not be able to state (its ALLOWS).
OPTIONAL = {
    "rope_scaling_factor": lambda spec: spec.rope_scaling_factor is not None,
    "sliding_window": lambda spec: spec.sliding_window is not None,
    "experts": lambda spec: spec.is_moe,
    "rotary_percent": lambda spec: spec.rotary_percent != 1.0,
    "yarn": lambda spec: spec.rope_type == "yarn",
    # another gated MLP than SwiGLU (gpt-oss' clamped quick-GEGLU)
    "activation_func": lambda spec: (spec.activation_func, spec.activation_func_clamp_value,
                                     spec.glu_linear_offset) != ("silu", None, 0.0),
    # biases on the output projection, the MLPs, the experts and the router (gpt-oss)
    "add_bias_linear": lambda spec: spec.add_bias_linear,
    # gpt-oss' attention: sinks, windows alternating with full layers
    "attention_sinks": lambda spec: spec.attention_sinks,
    "window_attn_skip_freq": lambda spec: spec.window_attn_skip_freq is not None,
}


def check_exportable(spec, family: str, fixed: Dict[str, Any], allows: Tuple[str, ...] = ()) -> None:
    """Export: ``spec`` has the values the family's architecture fixes (``fixed``, the ones its import
    sets) and no OPTIONAL feature but those it ``allows``; otherwise a ConfigError naming each field."""
    named = [f"{field}={getattr(spec, field)!r}" for field, value in fixed.items() if getattr(spec, field) != value]
    named += [field for field, present in OPTIONAL.items() if field not in allows and present(spec)]
    if named:
        raise ConfigError(f"model {spec.name}: {', '.join(named)} cannot be written as a {family} checkpoint "
                          f"(set family to one that has it, or change the field)")


# The MoE fields a plain softmax-top-k checkpoint (Mixtral's, gpt-oss') has no tensor or key for
PLAIN_MOE_UNSET = ("moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias",
                   "moe_router_topk_scaling_factor", "moe_router_num_groups")


def check_moe_exportable(spec, family: str, unset: Tuple[str, ...] = PLAIN_MOE_UNSET) -> None:
    """A family whose every layer is MoE: ``spec`` has experts and none of the ``unset`` fields
    (a ConfigError naming them)."""
    if not spec.is_moe:
        raise ConfigError(f"model {spec.name}: a {family} checkpoint has MoE layers; set num_experts or another family")
    extras = [f for f in unset if getattr(spec, f)]
    if extras:
        raise ConfigError(f"model {spec.name}: {', '.join(extras)} cannot be written as a {family} checkpoint "
                          f"(set family to one that has it, or change the field)")


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoint keeps an MoE layer's tensors, below ``model.layers.{i}.`` (a
    family with MoE layers sets ``EXPERT_NAMES``); ``expert`` takes the expert index as ``{e}``.
    ``shared``: the shared expert's prefix (its gate_proj / up_proj / down_proj); ``expert_bias``: the
    router's selection bias (DeepSeek's e_score_correction_bias); None where the family has none."""
    router: str
    expert: str
    gate: str
    up: str
    down: str
    shared: Optional[str] = None
    expert_bias: Optional[str] = None


@dataclass(frozen=True)
class Stack:
    """A family whose checkpoints keep an MoE layer's experts stacked (gpt-oss; read and written per
    expert by ``hf/stacked.py``): one stacked tensor of a layer (below ``model.layers.{i}.``), its experts
    along dim 0, each expert's ``parts`` (names below ``expert``, which takes ``{e}``) interleaved along
    the last dim; ``transposed``: each part is stored as ``x @ W`` ([in, out]), the Linear weight is its
    transpose."""
    stacked: str
    parts: Tuple[str, ...]
    expert: str
    transposed: bool


# Qwen3-MoE's names: mlp.gate, mlp.experts.{e}.{gate,up,down}_proj
QWEN_EXPERT_NAMES = ExpertNames("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj.weight", "up_proj.weight",
                                "down_proj.weight")
# DeepSeek-V3's (and GLM-4.5's): Qwen3-MoE's plus the shared experts and the selection bias
DEEPSEEK_EXPERT_NAMES = ExpertNames("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj.weight", "up_proj.weight",
                                    "down_proj.weight", shared="mlp.shared_experts.",
                                    expert_bias="mlp.gate.e_score_correction_bias")


def deepseek_moe_fields(cfg: Dict[str, Any], num_layers: int, family: str, where: str) -> Dict[str, Any]:
    """DeepSeek-V3's MoE block (also GLM-4.5's) from config.json: sigmoid scores, experts selected on
    score + ``e_score_correction_bias``, the chosen unbiased scores renormalised (``norm_topk_prob``)
    and scaled by ``routed_scaling_factor``, ``n_shared_experts`` shared experts as one, leading dense
    layers (``first_k_dense_replace``), group-limited routing where megatron's group score is
    transformers' (the top 2 experts of a group: top-k / topk_group = 2)."""
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
    moe = int(cfg["moe_intermediate_size"])
    scaling = float(cfg.get("routed_scaling_factor", 1.0))
    dense = int(cfg.get("first_k_dense_replace", 0))
    if dense >= num_layers:
        raise ConfigError(f"{where}: first_k_dense_replace={dense} must be below num_hidden_layers={num_layers} "
                          f"(a {family} model has MoE layers)")
    return dict(num_experts=int(cfg["n_routed_experts"]), moe_ffn_hidden_size=moe, moe_router_topk=topk,
                moe_router_num_groups=groups if limited else None,
                moe_router_group_topk=top_groups if limited else None,
                moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                moe_shared_expert_intermediate_size=int(cfg.get("n_shared_experts") or 0) * moe or None,
                first_k_dense=dense)


def deepseek_moe_config(spec, family: str) -> Dict[str, Any]:
    """The config.json keys of ``deepseek_moe_fields`` (its inverse)."""
    if not spec.is_moe:
        raise ConfigError(f"model {spec.name}: a {family} checkpoint has MoE layers; set num_experts or another family")
    shared, moe = spec.moe_shared_expert_intermediate_size or 0, spec.moe_ffn_hidden_size or spec.ffn_hidden_size
    if shared % moe:
        raise ConfigError(f"model {spec.name}: moe_shared_expert_intermediate_size={shared} cannot be written as a "
                          f"{family} checkpoint (n_shared_experts * moe_intermediate_size={moe})")
    return dict(moe_intermediate_size=moe, n_routed_experts=spec.num_experts, num_experts_per_tok=spec.moe_router_topk,
                n_shared_experts=shared // moe, first_k_dense_replace=spec.first_k_dense, norm_topk_prob=True,
                routed_scaling_factor=spec.moe_router_topk_scaling_factor or 1.0,
                n_group=spec.moe_router_num_groups or 1, topk_group=spec.moe_router_group_topk or 1,
                num_nextn_predict_layers=0)


# The sigmoid router with its selection bias, as DeepSeek-V3's MoE block fixes it (import sets, export checks)
DEEPSEEK_ROUTER = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_pre_softmax=False)
