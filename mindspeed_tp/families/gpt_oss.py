"""gpt-oss (transformers' gpt_oss, vLLM's gpt_oss.py): an MoE block in every layer; attention with a
learned sink logit per head (``self_attn.sinks``: megatron's softmax_type 'learnable'), biases on q /
k / v / o, windows of ``sliding_window`` keys on the layers ``layer_types`` marks sliding, alternating
with full ones from the first (megatron's window_attn_skip_freq 2), YaRN RoPE without rounding its
ramp ends (``truncate: false``). The router has a bias; it takes the top-k logits, then the softmax
over those k (megatron's top-k then softmax). Each expert's GLU is gpt-oss' clamped quick-GEGLU:
``gate * sigmoid(swiglu_alpha * gate) * (up + 1)``, gate clamped above and up into ±``swiglu_limit``
(megatron's quick_gelu, activation_func_clamp_value, glu_linear_offset 1), with biases on fc1 and
fc2. The checkpoint keeps the experts stacked (``mlp.experts.gate_up_proj`` [E, H, 2I], gate and up
interleaved; ``down_proj`` [E, I, H]; their biases): read and written per expert by
``hf/stacked.py``."""
from __future__ import annotations

from typing import Any, Dict

from ..contract.refusals import refuse
from ..errors import ConfigError
from .common import (ExpertNames, Stack, check_exportable, check_model_type, check_moe_exportable, decoder_config,
                     decoder_fields, rope_fields)

NAME = "gpt_oss"
ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
# megatron's quick_gelu is x * sigmoid(1.702 x): gpt-oss' swiglu_alpha
QUICK_GELU_ALPHA = 1.702
FIXED = dict(qk_layernorm=False, add_qkv_bias=True, add_bias_linear=True, attention_sinks=True,
             moe_router_score_function="softmax", moe_router_pre_softmax=False, first_k_dense=0,
             activation_func="quick_gelu", glu_linear_offset=1.0)  # import sets, export checks
EXPERT_NAMES = ExpertNames("mlp.router.weight", "mlp.experts.{e}.", "gate_proj.weight", "up_proj.weight",
                           "down_proj.weight")
STACKED_EXPERTS = (
    Stack("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"), "mlp.experts.{e}.", transposed=True),
    Stack("mlp.experts.gate_up_proj_bias", ("gate_proj.bias", "up_proj.bias"), "mlp.experts.{e}.", transposed=False),
    Stack("mlp.experts.down_proj", ("down_proj.weight",), "mlp.experts.{e}.", transposed=True),
    Stack("mlp.experts.down_proj_bias", ("down_proj.bias",), "mlp.experts.{e}.", transposed=False),
)


def _window_fields(cfg: Dict[str, Any], layers: int, where: str) -> Dict[str, Any]:
    """``layer_types``: sliding on the odd 1-based layers, full on the even ones (megatron's skip
    frequency 2), or full everywhere; any other pattern is refused by name."""
    types = list(cfg.get("layer_types") or [])
    if not types or all(t == "full_attention" for t in types):
        return dict(sliding_window=None, window_attn_skip_freq=None)
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if types != alternating or not cfg.get("sliding_window"):
        raise refuse("hf_sliding_window", where=where)
    return dict(sliding_window=int(cfg["sliding_window"]), window_attn_skip_freq=2)


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    check_model_type(cfg, "gpt_oss", architecture, where)
    if not cfg.get("attention_bias", True):
        raise ConfigError(f"{where}: attention_bias false: gpt-oss' biases are on every linear layer or none; "
                          f"not mapped")
    if float(cfg.get("swiglu_alpha", QUICK_GELU_ALPHA)) != QUICK_GELU_ALPHA:
        raise refuse("hf_hidden_act", where=where, act=f"swiglu_alpha={cfg.get('swiglu_alpha')} (megatron's quick_gelu "
                                                       f"is {QUICK_GELU_ALPHA})")
    limit = cfg.get("swiglu_limit", 7.0)
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if not experts:
        raise ConfigError(f"{where}: gpt-oss config without num_local_experts")
    fields = dict(decoder_fields(dict(cfg, hidden_act="silu"), name, where),
                  **rope_fields(cfg, where, scalings=("yarn",)), family=NAME, **FIXED)
    layers = fields["num_layers"]
    fields.update(_window_fields(cfg, layers, where),
                  activation_func_clamp_value=None if limit is None else float(limit),
                  num_experts=int(experts), moe_ffn_hidden_size=fields["ffn_hidden_size"],
                  moe_router_topk=int(cfg["num_experts_per_tok"]))
    return fields


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    check_moe_exportable(spec, "gpt-oss")
    if spec.window_attn_skip_freq not in (None, 2):
        raise ConfigError(f"model {spec.name}: window_attn_skip_freq={spec.window_attn_skip_freq} cannot be written "
                          f"as a gpt-oss checkpoint (its layer_types alternate: 2)")
    check_exportable(spec, "gpt-oss", FIXED, allows=("experts", "yarn", "sliding_window", "activation_func",
                                                      "add_bias_linear", "attention_sinks", "window_attn_skip_freq"))
    cfg = decoder_config(spec, "GptOssForCausalLM", "gpt_oss", dtype)
    layers = spec.num_layers
    if spec.sliding_window is None:
        types = ["full_attention"] * layers
    elif spec.window_attn_skip_freq is None:
        raise ConfigError(f"model {spec.name}: a window on every layer cannot be written as a gpt-oss checkpoint "
                          f"(its layer_types alternate: set window_attn_skip_freq: 2)")
    else:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    cfg.update(attention_bias=True, num_local_experts=spec.num_experts, num_experts_per_tok=spec.moe_router_topk,
               intermediate_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size, layer_types=types,
               sliding_window=spec.sliding_window or 128, swiglu_alpha=QUICK_GELU_ALPHA,
               swiglu_limit=spec.activation_func_clamp_value, router_aux_loss_coef=0.0, output_router_logits=False)
    return cfg
