"""Model architecture configs (YAML) for the bundled models and user-given files."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import yaml

from ..errors import ConfigError

# The gated MLPs' activations (kernels/elementwise.ACTIVATIONS computes them; models sit below kernels)
GATED_ACTIVATIONS = ("silu", "quick_gelu")

MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "models")


@dataclass(frozen=True)
class ModelSpec:
    """A pre-norm decoder: RMSNorm, RoPE, SwiGLU, GQA; per family (``mindspeed_tp.families``): QK-norm
    (Qwen3), a QKV bias (Qwen2 / Qwen2.5), Llama-3's scaled RoPE, a sliding window (Mistral), tied
    embeddings, MoE layers, MLA (DeepSeek-V3), gpt-oss' sinks, alternating windows, biases and GLU."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = True
    tie_word_embeddings: bool = False
    # The Hugging Face family (families.FAMILIES): config.json and tensor names on import / export.
    family: str = "qwen3"
    # A bias on the q, k and v projections (Qwen2 / Qwen2.5): Megatron's add_qkv_bias.
    add_qkv_bias: bool = False
    # Biases on every other linear layer (gpt-oss): the attention output projection, fc1 and fc2 of the
    # MLPs and of each routed expert, the router. Megatron's add_bias_linear (it implies add_qkv_bias).
    add_bias_linear: bool = False
    # Llama-3's RoPE scaling (rope_type llama3) by this factor, with Megatron's fixed low / high
    # frequency factors 1 / 4 and original context 8192 (GPTModel's rope_scaling / rope_scaling_factor).
    rope_scaling_factor: Optional[float] = None
    # The share of each head's channels RoPE rotates, the leading ones (GLM-4.5's partial_rotary_factor
    # 0.5; GPTModel's rotary_percent); the rest pass through.
    rotary_percent: float = 1.0
    # Sliding-window attention in every layer (Mistral 7B v0.1): each query sees itself and the W - 1
    # keys before it (Hugging Face sliding_window W; Megatron's window_size (W - 1, 0)).
    sliding_window: Optional[int] = None
    # gpt-oss' alternation: with sliding_window, layer L (1-based) is windowed unless L is a multiple of
    # this (2: odd layers windowed, even ones full; megatron's window_attn_skip_freq, >= 0.15).
    window_attn_skip_freq: Optional[int] = None
    # gpt-oss' attention sinks: a learned logit per head in every query's softmax denominator, with no
    # value (megatron's softmax_type 'learnable', its softmax_offset parameter; >= 0.15).
    attention_sinks: bool = False
    # The gated MLP (dense layers and experts), megatron's unfused glu: activation_func(gate) * (up +
    # glu_linear_offset), with activation_func_clamp_value the gate clamped above at it and up into
    # [-value, value]. silu / unset / 0 is SwiGLU; quick_gelu (x * sigmoid(1.702 x)) / 7 / 1 is gpt-oss'
    # clamped GEGLU (megatron-core >= 0.14 has the fields).
    activation_func: str = "silu"
    activation_func_clamp_value: Optional[float] = None
    glu_linear_offset: float = 0.0
    # Multi-latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight; megatron's MLATransformerConfig, same
    # names): queries through a q_lora_rank latent (None: one projection), keys and values through a
    # kv_lora_rank latent; a head's query and key are qk_head_dim channels without RoPE, then
    # qk_pos_emb_head_dim with it (one rope key shared by the heads); its value v_head_dim channels.
    # kv_channels is then the query/key head, qk_head_dim + qk_pos_emb_head_dim.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_head_dim: Optional[int] = None
    qk_pos_emb_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # RoPE frequencies: rope (plain) | yarn (megatron's YarnRotaryEmbedding with the fields below, cos
    # and sin scaled by its mscale ratio; MLA: its softmax scale by the square of mscale_all_dim's;
    # standard attention: GPTModel's position_embedding_type yarn, the whole head, Qwen2.5 / Qwen3's
    # long context and gpt-oss). correction_range_round_to_int: the ramp's ends rounded out to whole
    # dimensions (transformers' truncate; gpt-oss keeps them unrounded).
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    correction_range_round_to_int: bool = True
    # Explicit padded vocab (Megatron's --make-vocab-size-divisible-by result); default: the
    # profile pads TP-independently to a multiple of vocab_pad_multiple * canonical_shards.
    padded_vocab_size: Optional[int] = None
    # MoE (unset num_experts: dense). Names follow Megatron's TransformerConfig.
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"   # softmax (Qwen3-MoE) | sigmoid (DeepSeek)
    moe_router_pre_softmax: bool = False         # False: normalised top-k (norm_topk_prob=True)
    moe_router_enable_expert_bias: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    # Group-limited routing (DeepSeek-V3's n_group / topk_group): experts in moe_router_num_groups
    # contiguous groups, each token choosing among its moe_router_group_topk best groups.
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    first_k_dense: int = 0                        # leading dense layers (DeepSeek first_k_dense_replace)
    moe_aux_loss_coeff: float = 0.0
    # aux_loss | seq_aux_loss | global_aux_loss (megatron-core >= 0.16) | none; default: aux_loss when
    # moe_aux_loss_coeff is set.
    moe_router_load_balancing_type: Optional[str] = None
    moe_z_loss_coeff: Optional[float] = None
    # Passed to Megatron as is; anything but None (dropless) is refused with --true-on-policy.
    moe_expert_capacity_factor: Optional[float] = None
    # Tests of the top-k tie-break: router rows [a, b] made identical, so experts a and b score
    # exactly equal for every token.
    tied_router_rows: Optional[List[List[int]]] = None

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model {self.name}: {f} must be a positive integer, got {value!r}")
        if self.num_experts is not None:
            if self.num_experts < 1 or self.moe_router_topk < 1 or self.moe_router_topk > self.num_experts:
                raise ConfigError(f"model {self.name}: need 1 <= moe_router_topk <= num_experts")
            if self.moe_router_score_function not in ("softmax", "sigmoid"):
                raise ConfigError(
                    f"model {self.name}: moe_router_score_function={self.moe_router_score_function!r} is not "
                    f"supported (router type); use softmax or sigmoid"
                )
            groups, chosen = self.moe_router_num_groups, self.moe_router_group_topk
            if (groups is None) != (chosen is None) or (groups is not None and (
                    not 1 <= chosen <= groups or self.num_experts % groups or self.moe_router_topk % chosen
                    or self.moe_router_topk > chosen * (self.num_experts // groups))):
                raise ConfigError(f"model {self.name}: moe_router_num_groups={groups} / moe_router_group_topk={chosen} "
                                  f"must both be set or unset, with group_topk <= num_groups, num_groups dividing "
                                  f"num_experts={self.num_experts}, group_topk dividing moe_router_topk="
                                  f"{self.moe_router_topk}, and the chosen groups holding at least top-k experts")
            if not 0 <= self.first_k_dense < self.num_layers:
                raise ConfigError(f"model {self.name}: first_k_dense must be in [0, num_layers)")
        if self.rope_scaling_factor is not None and not self.rope_scaling_factor >= 1.0:
            raise ConfigError(f"model {self.name}: rope_scaling_factor must be >= 1 (Llama-3's factor), "
                              f"got {self.rope_scaling_factor!r}; remove it for unscaled RoPE")
        rotated = int(self.kv_channels * self.rotary_percent)
        if not 0.0 < self.rotary_percent <= 1.0 or rotated % 2 or rotated < 2:
            raise ConfigError(f"model {self.name}: rotary_percent={self.rotary_percent!r} must be in (0, 1] and "
                              f"rotate an even number of the head's {self.kv_channels} channels (got {rotated})")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ConfigError(f"model {self.name}: sliding_window must be a positive integer (keys a query sees, "
                              f"itself included), got {self.sliding_window!r}; remove it for full attention")
        if self.activation_func not in GATED_ACTIVATIONS:
            raise ConfigError(f"model {self.name}: activation_func={self.activation_func!r} is not one of "
                              f"{sorted(GATED_ACTIVATIONS)} (the gated MLPs the patches compute)")
        clamp = self.activation_func_clamp_value
        if clamp is not None and not (isinstance(clamp, (int, float)) and clamp > 0):
            raise ConfigError(f"model {self.name}: activation_func_clamp_value must be a positive number, got "
                              f"{clamp!r}; remove it for an unclamped GLU")
        skip = self.window_attn_skip_freq
        if skip is not None and (self.sliding_window is None or not isinstance(skip, int) or skip < 2):
            raise ConfigError(f"model {self.name}: window_attn_skip_freq={skip!r} needs sliding_window and an integer "
                              f">= 2 (every skip-th layer full); remove it to window every layer")
        if self.add_bias_linear and not self.add_qkv_bias:
            raise ConfigError(f"model {self.name}: add_bias_linear biases the QKV projection too (megatron's "
                              f"add_qkv_bias follows it): set add_qkv_bias: true as well")
        if self.add_bias_linear and self.moe_shared_expert_intermediate_size:
            raise ConfigError(f"model {self.name}: megatron's shared experts have no biases: add_bias_linear "
                              f"needs moe_shared_expert_intermediate_size unset")
        if self.rope_type not in ("rope", "yarn"):
            raise ConfigError(f"model {self.name}: rope_type={self.rope_type!r}: use rope or yarn")
        if self.rope_type == "yarn" and not (self.original_max_position_embeddings or 0) >= 1:
            raise ConfigError(f"model {self.name}: rope_type yarn needs original_max_position_embeddings")
        if self.multi_latent_attention:
            self._check_mla()
        elif self.rope_type == "yarn" and (self.rotary_percent != 1.0 or self.rope_scaling_factor is not None):
            raise ConfigError(f"model {self.name}: rope_type yarn rotates the whole head with YaRN's frequencies: "
                              f"remove rotary_percent and rope_scaling_factor (megatron's YarnRotaryEmbedding)")
        from ..families import FAMILIES

        if self.family not in FAMILIES:
            raise ConfigError(f"model {self.name}: family={self.family!r} is not one of {sorted(FAMILIES)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model {self.name}: num_attention_heads={self.num_attention_heads} is not divisible "
                f"by num_query_groups={self.num_query_groups}"
            )

    def _check_mla(self) -> None:
        dims = {f: getattr(self, f) for f in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")}
        if self.q_lora_rank is not None:
            dims["q_lora_rank"] = self.q_lora_rank
        bad = {f: v for f, v in dims.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ConfigError(f"model {self.name}: multi_latent_attention needs positive integers for {sorted(bad)} "
                              f"(q_lora_rank may be unset: one query projection)")
        if self.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"model {self.name}: qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even (RoPE "
                              f"rotates channel pairs)")
        if self.kv_channels != self.qk_head_dim + self.qk_pos_emb_head_dim:
            raise ConfigError(f"model {self.name}: with multi_latent_attention kv_channels is the query/key head, "
                              f"qk_head_dim + qk_pos_emb_head_dim = {self.qk_head_dim + self.qk_pos_emb_head_dim}; "
                              f"got {self.kv_channels}")
        if self.num_query_groups != self.num_attention_heads or self.rotary_percent != 1.0 or \
                self.rope_scaling_factor is not None or self.sliding_window is not None or self.add_qkv_bias or \
                self.attention_sinks:
            raise ConfigError(f"model {self.name}: multi_latent_attention takes num_query_groups = num_attention_heads "
                              f"and none of rotary_percent, rope_scaling_factor, sliding_window, add_qkv_bias, "
                              f"attention_sinks")
        if not self.qk_layernorm:
            raise ConfigError(f"model {self.name}: multi_latent_attention needs qk_layernorm: true (megatron's local "
                              f"MLA spec builds the latent norms only then)")
        if not self.correction_range_round_to_int:
            raise ConfigError(f"model {self.name}: megatron's MLA rounds YaRN's ramp ends to whole dimensions: remove "
                              f"correction_range_round_to_int")

    @property
    def attention_heads_kv(self) -> int:
        """Key/value heads the attention kernel sees (MLA: one per query head, after the up-projection)."""
        return self.num_attention_heads if self.multi_latent_attention else self.num_query_groups

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.multi_latent_attention else self.kv_channels

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def rotary_dim(self) -> int:
        """The channels RoPE rotates (megatron's RotaryEmbedding: int(kv_channels * rotary_percent); MLA:
        the rope channels)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)

    def padded_vocab(self, profile) -> int:
        if self.padded_vocab_size is None:
            return profile.padded_vocab_size(self.vocab_size)
        if self.padded_vocab_size < self.vocab_size or self.padded_vocab_size % profile.canonical_shards:
            raise ConfigError(
                f"model {self.name}: padded_vocab_size={self.padded_vocab_size} must be >= vocab_size="
                f"{self.vocab_size} and divisible by canonical_shards={profile.canonical_shards} "
                f"(remove padded_vocab_size to let the profile pad it)"
            )
        return self.padded_vocab_size

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def bundled_models():
    return sorted(p[:-5] for p in os.listdir(MODEL_DIR) if p.endswith(".yaml"))


def load_model_spec(name_or_path: str) -> ModelSpec:
    path = name_or_path
    if not os.path.isfile(path):
        path = os.path.join(MODEL_DIR, f"{name_or_path}.yaml")
        if not os.path.isfile(path):
            raise ConfigError(
                f"--model {name_or_path!r} is neither a model config file nor a bundled model; "
                f"bundled models: {bundled_models()}"
            )
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"model config {path} must be a mapping")
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"model config {path}: unknown field(s) {unknown}; known: {sorted(known)}")
    return ModelSpec(**data)
