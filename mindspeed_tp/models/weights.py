"""Seeded full-size weights, identical in every layout, sliced into this rank's shards.

Every tensor is generated at its TP=1/PP=1 shape from (seed, global name) alone, then sliced by
the same rules Megatron uses to shard it, so any two layouts hold the same logical weights.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, Tuple

import torch

from .spec import ModelSpec

# Parameter name suffix -> how Megatron shards it across TP ranks.
_COLUMN = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
           "linear_fc1.weight", "linear_fc1.bias",
           # MLA's projections: megatron's local spec builds even the down projections column-parallel
           "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
           "linear_kv_down_proj.weight", "linear_kv_up_proj.weight",
           # attention sinks (softmax_type learnable): one per head, split with the heads
           "core_attention.softmax_offset")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_GATED = ("linear_fc1.weight", "linear_fc1.bias")


def shard_rule(name: str) -> str:
    if name.endswith(_GATED):
        return "column_gated"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def global_param_name(model, local_name: str, ep_rank: int = 0) -> str:
    """Global name: decoder.layers.<local>.* renumbered to the global layer index (PP stages
    number from 0), and experts.local_experts.<j> to the global expert index (EP ranks hold
    contiguous runs of experts). With tied embeddings a last pipeline stage's own copy of the shared
    weight (output_layer.weight) is the embedding's: megatron keeps the two equal."""
    if local_name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        layer = model.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
        if "local_experts" in parts:
            i = parts.index("local_experts")
            num_local = len(layer.mlp.experts.local_experts)
            parts[i + 1] = str(ep_rank * num_local + int(parts[i + 1]))
    return ".".join(parts)


def full_shape(rule: str, local_shape: Tuple[int, ...], tp: int) -> Tuple[int, ...]:
    shape = list(local_shape)
    if rule in ("column", "column_gated"):
        shape[0] *= tp
    elif rule == "row":
        shape[1] *= tp
    return tuple(shape)


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def seeded_full_tensor(seed: int, name: str, shape: Tuple[int, ...], spec: ModelSpec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    t = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * t
    if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
        t = t if name.endswith("word_embeddings.weight") else t / shape[1] ** 0.5
        t[spec.vocab_size:] = 0.0  # TP-independent vocab padding rows
        return t
    if name.endswith("softmax_offset"):  # sink logits of the size real ones have (gpt-oss: about -3 .. 5)
        return t
    if name.endswith("router.weight"):
        t = t / shape[1] ** 0.5
        for a, b in spec.tied_router_rows or ():
            t[b] = t[a]
        return t
    if len(shape) == 2:
        return t / shape[1] ** 0.5
    return 0.02 * t


def shard(full: torch.Tensor, rule: str, tp: int, rank: int) -> torch.Tensor:
    if rule == "column":
        return full.chunk(tp, dim=0)[rank]
    if rule == "column_gated":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    if rule == "row":
        return full.chunk(tp, dim=1)[rank]
    return full


def unshard(parts, rule: str) -> torch.Tensor:
    """Inverse of ``shard``: the full tensor from its shards in rank order."""
    if rule == "column":
        return torch.cat(parts, dim=0)
    if rule == "column_gated":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if rule == "row":
        return torch.cat(parts, dim=1)
    return parts[0]


class SeededWeights:
    """Weight source: every full tensor generated from (seed, global name) alone."""

    def __init__(self, spec: ModelSpec, seed: int):
        self.spec, self.seed = spec, seed

    def full(self, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
        if name.endswith("router.expert_bias"):
            return seeded_expert_bias(self.seed, name, shape)
        return seeded_full_tensor(self.seed, name, shape, self.spec)

    def shard(self, name: str, rule: str, full_shape: Tuple[int, ...], size: int, rank: int) -> torch.Tensor:
        return shard(self.full(name, full_shape), rule, size, rank)

    def describe(self) -> Dict[str, object]:
        """What every rank must agree on (the checker compares it across ranks)."""
        return {"kind": "seeded", "seed": self.seed}

    def digest(self, profile) -> str:
        """Of the weights as this process generates them (two nodes whose torch draws differently
        differ here)."""
        return seeded_weights_digest(self.spec, profile, self.seed)


def is_expert_weight(name: str) -> bool:
    """A routed expert's weight (global name): split over expert TP, held by one EP rank."""
    return ".local_experts." in name


def param_shards(model, spec: ModelSpec, layout):
    """(global name, parameter, shard rule, shard group size, rank in it) for every parameter of this
    stage: expert weights are split over expert-TP, the rest over TP."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = layout.tp, ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank() if spec.is_moe else 0
    etp_rank = ps.get_expert_tensor_parallel_rank() if spec.is_moe else 0
    for local_name, param in model.named_parameters():
        name = global_param_name(model, local_name, ep_rank)
        size, rank = (layout.etp, etp_rank) if is_expert_weight(name) else (tp, tp_rank)
        yield name, param, shard_rule(name), size, rank


def load_weights(model, spec: ModelSpec, layout, source) -> Dict[str, str]:
    """Fill every parameter of this stage (and the routers' expert biases) with its shard of the
    source's full weights (Megatron TP=1 names). ``source`` is a SeededWeights or a checkpoint
    (mindspeed_tp.hf.HFWeights)."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank() if spec.is_moe else 0
    rules = {}
    with torch.no_grad():
        for name, param, rule, size, rank in param_shards(model, spec, layout):
            part = source.shard(name, rule, full_shape(rule, tuple(param.shape), size), size, rank)
            param.copy_(part.to(param.dtype))
            rules[name] = rule
        for local_name, buf in model.named_buffers():
            if local_name.endswith("router.expert_bias"):
                name = global_param_name(model, local_name, ep_rank)
                buf.copy_(source.full(name, tuple(buf.shape)))
    return rules


def load_seeded_weights(model, spec: ModelSpec, seed: int, layout) -> Dict[str, str]:
    return load_weights(model, spec, layout, SeededWeights(spec, seed))


def full_weight_shapes(spec: ModelSpec, padded_vocab: int) -> Dict[str, Tuple[int, ...]]:
    """Megatron's TP=1/PP=1/EP=1 parameter names and shapes for ``spec`` (what the seeded weights
    are generated at), plus the routers' expert-bias buffers. Checked against a real GPTModel in
    tests/test_reference_engine.py."""
    h, hd = spec.hidden_size, spec.kv_channels
    qkv = (spec.num_attention_heads + 2 * spec.num_query_groups) * hd
    shapes = {"embedding.word_embeddings.weight": (padded_vocab, h)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if spec.multi_latent_attention:
            shapes.update(_mla_shapes(spec, p + "self_attention."))
        else:
            shapes[p + "self_attention.linear_qkv.weight"] = (qkv, h)
            if spec.add_qkv_bias or spec.add_bias_linear:
                shapes[p + "self_attention.linear_qkv.bias"] = (qkv,)
            if spec.attention_sinks:
                shapes[p + "self_attention.core_attention.softmax_offset"] = (spec.num_attention_heads,)
            if spec.qk_layernorm:
                shapes[p + "self_attention.q_layernorm.weight"] = (hd,)
                shapes[p + "self_attention.k_layernorm.weight"] = (hd,)
        shapes.update(_linear_shapes(spec, p + "self_attention.linear_proj", h, spec.num_attention_heads * spec.value_head_dim))
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        if spec.is_moe and i >= spec.first_k_dense:
            f = spec.moe_ffn_hidden_size or spec.ffn_hidden_size
            shapes.update(_linear_shapes(spec, p + "mlp.router", spec.num_experts, h))
            if spec.moe_router_enable_expert_bias:
                shapes[p + "mlp.router.expert_bias"] = (spec.num_experts,)
            for e in range(spec.num_experts):
                shapes.update(_mlp_shapes(spec, p + f"mlp.experts.local_experts.{e}.", f))
            if spec.moe_shared_expert_intermediate_size:
                shapes.update(_mlp_shapes(spec, p + "mlp.shared_experts.", spec.moe_shared_expert_intermediate_size))
        else:
            shapes.update(_mlp_shapes(spec, p + "mlp.", spec.ffn_hidden_size))
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["output_layer.weight"] = (padded_vocab, h)
    return shapes


def _linear_shapes(spec: ModelSpec, name: str, out_features: int, in_features: int) -> Dict[str, Tuple[int, ...]]:
    """A linear layer's weight, and its bias where the model has them (add_bias_linear)."""
    shapes = {name + ".weight": (out_features, in_features)}
    if spec.add_bias_linear:
        shapes[name + ".bias"] = (out_features,)
    return shapes


def _mlp_shapes(spec: ModelSpec, p: str, ffn: int) -> Dict[str, Tuple[int, ...]]:
    """A gated MLP's fc1 ([gate; up]) and fc2."""
    return {**_linear_shapes(spec, p + "linear_fc1", 2 * ffn, spec.hidden_size),
            **_linear_shapes(spec, p + "linear_fc2", spec.hidden_size, ffn)}


def _mla_shapes(spec: ModelSpec, p: str) -> Dict[str, Tuple[int, ...]]:
    """MLA's projections and latent norms (megatron's MLASelfAttention names)."""
    h, n, kv = spec.hidden_size, spec.num_attention_heads, spec.kv_lora_rank
    shapes = {}
    if spec.q_lora_rank is None:
        shapes[p + "linear_q_proj.weight"] = (n * spec.kv_channels, h)
    else:
        shapes[p + "linear_q_down_proj.weight"] = (spec.q_lora_rank, h)
        shapes[p + "q_layernorm.weight"] = (spec.q_lora_rank,)
        shapes[p + "linear_q_up_proj.weight"] = (n * spec.kv_channels, spec.q_lora_rank)
    shapes[p + "linear_kv_down_proj.weight"] = (kv + spec.qk_pos_emb_head_dim, h)
    shapes[p + "kv_layernorm.weight"] = (kv,)
    shapes[p + "linear_kv_up_proj.weight"] = (n * (spec.qk_head_dim + spec.v_head_dim), kv)
    return shapes


def seeded_expert_bias(seed: int, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    return 0.05 * torch.randn(shape, generator=gen)


def full_weights(spec: ModelSpec, padded_vocab: int, source, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Every full tensor as a TP=1 Megatron model in ``dtype`` holds it after load_weights."""
    return {name: source.full(name, shape).to(dtype) for name, shape in full_weight_shapes(spec, padded_vocab).items()}


def seeded_full_weights(spec: ModelSpec, padded_vocab: int, seed: int, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    return full_weights(spec, padded_vocab, SeededWeights(spec, seed), dtype)


def seeded_weights_digest(spec: ModelSpec, profile, seed: int, budget: int = 1 << 22) -> str:
    """Digest of the seeded weights as this process generates them, over the first tensors of at
    most 2^20 elements until ``budget`` elements (all of a tiny model; norms and the first small
    projections of a large one): enough to catch two nodes whose torch draws different random
    numbers, without generating a large model on every rank."""
    h = hashlib.sha256()
    used = 0
    for name, shape in full_weight_shapes(spec, spec.padded_vocab(profile)).items():
        size = math.prod(shape)
        if size > 1 << 20 or used + size > budget:
            continue
        used += size
        t = (seeded_expert_bias(seed, name, shape) if name.endswith("router.expert_bias")
             else seeded_full_tensor(seed, name, shape, spec))
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()
