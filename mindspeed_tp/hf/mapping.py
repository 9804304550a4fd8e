"""Tensor-by-tensor map between Hugging Face names (the families' one naming; an MoE layer's by its
family's EXPERT_NAMES) and Megatron's TP=1 names; which tensors exist follows the spec (QK-norm,
QKV bias, tied embeddings).

Every Megatron tensor is a concatenation, along dim 0, of row ranges of Hugging Face tensors (or
of zero rows, for vocabulary padding):
- linear_qkv (weight and bias): per query group g, the group's q heads, then its k head, then its v
  head (GQA);
- linear_fc1 (dense, shared and expert MLPs): gate_proj rows, then up_proj rows (SwiGLU; Mixtral's
  w1, then w3);
- the router's expert bias (a buffer megatron keeps in fp32): DeepSeek's / GLM's e_score_correction_bias;
- biases on every linear layer (add_bias_linear, gpt-oss): each beside its weight (``x.bias``), fc1's
  gate rows then up rows; attention sinks (gpt-oss' ``self_attn.sinks``): megatron's softmax_offset;
- word embeddings / output layer: the vocabulary rows, then zero rows up to the padded vocab.
Everything else maps one to one (MLA's projections and latent norms included). The same pieces serve loading (any shard is a set of row or
column ranges of them) and exporting (writing the pieces back).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..models.spec import ModelSpec


@dataclass(frozen=True)
class Piece:
    hf_name: Optional[str]  # None: zero rows (vocabulary padding; dropped on export)
    start: int              # rows [start, stop) of the Hugging Face tensor
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def _whole(hf_name: str, rows: int) -> List[Piece]:
    return [Piece(hf_name, 0, rows)]


def _expert_names(spec: ModelSpec):
    """The MoE tensors' names in the family's checkpoints (families/common.ExpertNames)."""
    from ..errors import ConfigError
    from ..families import FAMILIES

    names = getattr(FAMILIES[spec.family], "EXPERT_NAMES", None)
    if names is None:
        raise ConfigError(f"model {spec.name}: family {spec.family!r} has no MoE layers; set the family of an MoE "
                          f"architecture (qwen3, mixtral, glm4_moe) or unset num_experts")
    for field, present in (("moe_shared_expert_intermediate_size", names.shared),
                           ("moe_router_enable_expert_bias", names.expert_bias)):
        if getattr(spec, field) and present is None:
            raise ConfigError(f"model {spec.name}: {field} has no tensor in a {spec.family} checkpoint; set the family "
                              f"of an architecture that has it (glm4_moe) or unset it")
    return names


def expected_hf_shapes(spec: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``spec`` holds, with its shape."""
    h, hd, nq, ng = spec.hidden_size, spec.kv_channels, spec.num_attention_heads, spec.num_query_groups
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if spec.multi_latent_attention:
            shapes.update({hf: shape for _, (hf, shape) in _mla_tensors(spec, "", p).items()})
        else:
            shapes.update({
                p + "self_attn.q_proj.weight": (nq * hd, h), p + "self_attn.k_proj.weight": (ng * hd, h),
                p + "self_attn.v_proj.weight": (ng * hd, h), p + "self_attn.o_proj.weight": (h, nq * hd),
            })
        if spec.qk_layernorm and not spec.multi_latent_attention:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if spec.add_qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (nq * hd,), p + "self_attn.k_proj.bias": (ng * hd,),
                           p + "self_attn.v_proj.bias": (ng * hd,)})
        if spec.attention_sinks:
            shapes[p + "self_attn.sinks"] = (nq,)
        biased = spec.add_bias_linear
        if biased:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if spec.is_moe and i >= spec.first_k_dense:
            f, n = spec.moe_ffn_hidden_size or spec.ffn_hidden_size, _expert_names(spec)
            shapes[p + n.router] = (spec.num_experts, h)
            if biased:
                shapes[p + _bias(n.router)] = (spec.num_experts,)
            for e in range(spec.num_experts):
                q = p + n.expert.format(e=e)
                shapes.update({q + n.gate: (f, h), q + n.up: (f, h), q + n.down: (h, f)})
                if biased:
                    shapes.update({q + _bias(n.gate): (f,), q + _bias(n.up): (f,), q + _bias(n.down): (h,)})
            if spec.moe_router_enable_expert_bias:
                shapes[p + n.expert_bias] = (spec.num_experts,)
            if spec.moe_shared_expert_intermediate_size:
                fs, q = spec.moe_shared_expert_intermediate_size, p + n.shared
                shapes.update({q + "gate_proj.weight": (fs, h), q + "up_proj.weight": (fs, h),
                               q + "down_proj.weight": (h, fs)})
        else:
            f = spec.ffn_hidden_size
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
            if biased:
                shapes.update({p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,),
                               p + "mlp.down_proj.bias": (h,)})
    return shapes


def _bias(weight_name: str) -> str:
    """A linear layer's bias tensor, beside its weight (``x.weight`` -> ``x.bias``)."""
    return weight_name[: -len("weight")] + "bias"


def _mla_tensors(spec: ModelSpec, p: str, q: str) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """MLA's tensors, one to one: Megatron name (below ``p``) -> (Hugging Face name (below ``q``), shape).
    Both keep a head's [no-rope; rope] query rows, the kv latent's [latent; rope key] rows and a head's
    [key; value] rows of kv_b_proj in the same order (the rope channels interleaved on both sides)."""
    h, n, kv, dr = spec.hidden_size, spec.num_attention_heads, spec.kv_lora_rank, spec.qk_pos_emb_head_dim
    a, b = p + "self_attention.", q + "self_attn."
    out = {}
    if spec.q_lora_rank is None:
        out[a + "linear_q_proj.weight"] = (b + "q_proj.weight", (n * spec.kv_channels, h))
    else:
        out[a + "linear_q_down_proj.weight"] = (b + "q_a_proj.weight", (spec.q_lora_rank, h))
        out[a + "q_layernorm.weight"] = (b + "q_a_layernorm.weight", (spec.q_lora_rank,))
        out[a + "linear_q_up_proj.weight"] = (b + "q_b_proj.weight", (n * spec.kv_channels, spec.q_lora_rank))
    out[a + "linear_kv_down_proj.weight"] = (b + "kv_a_proj_with_mqa.weight", (kv + dr, h))
    out[a + "kv_layernorm.weight"] = (b + "kv_a_layernorm.weight", (kv,))
    out[a + "linear_kv_up_proj.weight"] = (b + "kv_b_proj.weight", (n * (spec.qk_head_dim + spec.v_head_dim), kv))
    out[a + "linear_proj.weight"] = (b + "o_proj.weight", (h, n * spec.v_head_dim))
    return out


def megatron_pieces(spec: ModelSpec, padded_vocab: int) -> Dict[str, List[Piece]]:
    """Megatron TP=1 name -> the Hugging Face row ranges it is made of, in order."""
    h, hd, nq, ng = spec.hidden_size, spec.kv_channels, spec.num_attention_heads, spec.num_query_groups
    per_group = nq // ng
    pad = [Piece(None, 0, padded_vocab - spec.vocab_size)] if padded_vocab > spec.vocab_size else []
    out = {"embedding.word_embeddings.weight": _whole("model.embed_tokens.weight", spec.vocab_size) + pad,
           "decoder.final_layernorm.weight": _whole("model.norm.weight", h)}
    # Tied embeddings: a last pipeline stage still holds its own output_layer copy; load it
    # from the embedding (export writes only the embedding).
    out["output_layer.weight"] = (out["embedding.word_embeddings.weight"] if spec.tie_word_embeddings
                                  else _whole("lm_head.weight", spec.vocab_size) + pad)

    def gated(hf_prefix: str, f: int) -> List[Piece]:
        return _whole(hf_prefix + "gate_proj.weight", f) + _whole(hf_prefix + "up_proj.weight", f)

    def grouped_qkv(q: str, kind: str) -> List[Piece]:
        pieces = []
        for g in range(ng):
            pieces += [Piece(q + f"self_attn.q_proj.{kind}", g * per_group * hd, (g + 1) * per_group * hd),
                       Piece(q + f"self_attn.k_proj.{kind}", g * hd, (g + 1) * hd),
                       Piece(q + f"self_attn.v_proj.{kind}", g * hd, (g + 1) * hd)]
        return pieces

    for i in range(spec.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": _whole(q + "input_layernorm.weight", h),
            p + "pre_mlp_layernorm.weight": _whole(q + "post_attention_layernorm.weight", h),
        })
        if spec.multi_latent_attention:
            out.update({name: _whole(hf, shape[0]) for name, (hf, shape) in _mla_tensors(spec, p, q).items()})
        else:
            out[p + "self_attention.linear_qkv.weight"] = grouped_qkv(q, "weight")
            out[p + "self_attention.linear_proj.weight"] = _whole(q + "self_attn.o_proj.weight", h)
        if spec.qk_layernorm and not spec.multi_latent_attention:
            out[p + "self_attention.q_layernorm.weight"] = _whole(q + "self_attn.q_norm.weight", hd)
            out[p + "self_attention.k_layernorm.weight"] = _whole(q + "self_attn.k_norm.weight", hd)
        if spec.add_qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = grouped_qkv(q, "bias")
        if spec.attention_sinks:
            out[p + "self_attention.core_attention.softmax_offset"] = _whole(q + "self_attn.sinks", nq)
        biased = spec.add_bias_linear
        if biased:
            out[p + "self_attention.linear_proj.bias"] = _whole(q + "self_attn.o_proj.bias", h)
        if spec.is_moe and i >= spec.first_k_dense:
            f, n = spec.moe_ffn_hidden_size or spec.ffn_hidden_size, _expert_names(spec)
            out[p + "mlp.router.weight"] = _whole(q + n.router, spec.num_experts)
            if biased:
                out[p + "mlp.router.bias"] = _whole(q + _bias(n.router), spec.num_experts)
            for e in range(spec.num_experts):
                m, x = p + f"mlp.experts.local_experts.{e}.", q + n.expert.format(e=e)
                out[m + "linear_fc1.weight"] = _whole(x + n.gate, f) + _whole(x + n.up, f)
                out[m + "linear_fc2.weight"] = _whole(x + n.down, h)
                if biased:
                    out[m + "linear_fc1.bias"] = _whole(x + _bias(n.gate), f) + _whole(x + _bias(n.up), f)
                    out[m + "linear_fc2.bias"] = _whole(x + _bias(n.down), h)
            if spec.moe_router_enable_expert_bias:
                out[p + "mlp.router.expert_bias"] = _whole(q + n.expert_bias, spec.num_experts)
            if spec.moe_shared_expert_intermediate_size:
                out[p + "mlp.shared_experts.linear_fc1.weight"] = gated(q + n.shared,
                                                                        spec.moe_shared_expert_intermediate_size)
                out[p + "mlp.shared_experts.linear_fc2.weight"] = _whole(q + n.shared + "down_proj.weight", h)
        else:
            out[p + "mlp.linear_fc1.weight"] = gated(q + "mlp.", spec.ffn_hidden_size)
            out[p + "mlp.linear_fc2.weight"] = _whole(q + "mlp.down_proj.weight", h)
            if biased:
                out[p + "mlp.linear_fc1.bias"] = (_whole(q + "mlp.gate_proj.bias", spec.ffn_hidden_size)
                                                  + _whole(q + "mlp.up_proj.bias", spec.ffn_hidden_size))
                out[p + "mlp.linear_fc2.bias"] = _whole(q + "mlp.down_proj.bias", h)
    return out
