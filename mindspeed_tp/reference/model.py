"""Single-device model of the bundled architectures, built from the same kernels, profile and
weights as the patched Megatron forward, computing any set of token rows of any requests.

Every op is either row-local or a row-invariant GEMM, and attention runs per request over its own
keys, so a token's result does not depend on which other tokens share the step: this is what lets
a rollout engine's prefill/decode logprobs equal the training forward's bit for bit.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Dict, List, Optional

import torch

from ..kernels import (
    apply_rope, decode_attention, mask_padded_vocab, folded_leaf_partials, invariant_linear, rms_norm, rope_angles, rope_inv_freq,
    vocab_parallel_logprob,
)
from ..kernels.elementwise import gated_linear_unit
from ..kernels.rope import mla_softmax_scale, yarn_inv_freq, yarn_mscale
from ..kernels.moe import combine_slots, route
from ..numerics.rollout_layout.engine_math import full_vocab_logprob, rollout_row_parallel
from ..models.spec import ModelSpec
from ..models.weights import full_weights, seeded_full_weights
from ..contract.profile import Profile
from ..contract.sampling import Sampling
from ..kernels.sampling import divide_by_temperature, mask_dropped_vocab, reference_mask


class ReferenceModel:
    def __init__(self, spec: ModelSpec, profile: Profile, weights: Dict[str, torch.Tensor], dtype: torch.dtype):
        self.spec, self.profile, self.w, self.dtype = spec, profile, weights, dtype
        self.padded_vocab = spec.padded_vocab(profile)
        self.inv_freq, self.rope_mscale, self.scale = rope_of(spec)
        # fc1's [gate; up] -> activation(gate) * (up + offset), clamped where the model clamps, as the patched MLP
        self.activation: Callable = functools.partial(gated_linear_unit, activation=spec.activation_func,
                                                      clamp=spec.activation_func_clamp_value,
                                                      offset=float(spec.glu_linear_offset))
        # Optional trace(name, input, output) called with each block's rows under the Megatron
        # module name it mirrors (the checker's --bisect aligns the two runs by these names).
        self.trace: Optional[Callable] = None

    def _record(self, name, inp, out):
        if self.trace is not None:
            self.trace(name, inp, out)

    @classmethod
    def seeded(cls, spec: ModelSpec, profile: Profile, seed: int, dtype: torch.dtype) -> "ReferenceModel":
        return cls(spec, profile, seeded_full_weights(spec, spec.padded_vocab(profile), seed, dtype), dtype)

    @classmethod
    def from_source(cls, spec: ModelSpec, profile: Profile, source, dtype: torch.dtype) -> "ReferenceModel":
        """From any weight source (models.weights.SeededWeights, hf.HFWeights)."""
        return cls(spec, profile, full_weights(spec, spec.padded_vocab(profile), source, dtype), dtype)
    @property
    def device(self) -> torch.device:
        return self.w["embedding.word_embeddings.weight"].device

    def to(self, device) -> "ReferenceModel":
        """Move the weights (e.g. to an NPU, where the kernels take the npu backend)."""
        self.w = {name: t.to(device) for name, t in self.w.items()}
        self.inv_freq = self.inv_freq.to(device)
        return self

    # -- building blocks, each mirroring one patched Megatron module --------------------------
    def _linear(self, x, name, out_dtype=None, bias=None):
        return invariant_linear(x, self.w[name], self.w.get(bias) if bias else None, out_dtype=out_dtype,
                                row_multiple=self.profile.gemm_row_multiple)

    def _row_parallel(self, x, prefix):
        """RowParallelLinear at TP=1 under the patches: C leaves folded, cast once, then its bias added
        in the model dtype (add_bias_linear); with reduction: rollout_layout, a stock engine at
        TP=rollout_tp (K/R partials, rounded, all-reduce; no bias)."""
        p = self.profile
        if p.rollout_layout:
            return rollout_row_parallel(x, self.w[prefix + "weight"], p, x.dtype)
        out = folded_leaf_partials(x, self.w[prefix + "weight"], p.canonical_shards, p.gemm_row_multiple).to(x.dtype)
        return self._add_bias(out, prefix)

    def _add_bias(self, x, prefix):
        """A skipped bias (fc1's, a row-parallel layer's) added in the model dtype, as the patched
        megatron adds it; none without add_bias_linear."""
        bias = self.w.get(prefix + "bias")
        return x if bias is None else x + bias

    def _norm(self, x, name):
        return rms_norm(x, self.w[name], self.spec.norm_epsilon)

    def _mlp(self, x, prefix, record: bool = False):
        a = self._add_bias(self._linear(x, prefix + "linear_fc1.weight"), prefix + "linear_fc1.")
        act = self.activation(a)
        out = self._row_parallel(act, prefix + "linear_fc2.")
        if record:
            self._record(prefix + "linear_fc1", x, a)
            self._record(prefix + "linear_fc2", act, out)
        return out

    def _moe(self, x, prefix):
        spec = self.spec
        logits = self._linear(x, prefix + "router.weight", out_dtype=torch.float32, bias=prefix + "router.bias")
        bias = self.w.get(prefix + "router.expert_bias")
        idx, probs = route(logits, spec.moe_router_topk, spec.moe_router_score_function, spec.moe_router_pre_softmax,
                           bias, spec.moe_router_topk_scaling_factor, spec.moe_router_num_groups,
                           spec.moe_router_group_topk)
        slots = torch.zeros(x.shape[0], idx.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            y = self._mlp(x.index_select(0, rows), prefix + f"experts.local_experts.{e}.")
            slots[rows, slot] = y
        out = combine_slots(slots, probs).to(x.dtype)
        if spec.moe_shared_expert_intermediate_size:
            out = out + self._mlp(x, prefix + "shared_experts.")
        return out, idx

    def _qkv(self, x, p: str, positions):
        """q [rows, nq, hd], k and v [rows, ng, hd] after their norms and RoPE."""
        spec = self.spec
        nq, ng, hd = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
        g = nq // ng
        qkv = self._linear(x, p + "linear_qkv.weight", bias=p + "linear_qkv.bias")
        self._record(p + "linear_qkv", x, qkv)
        qkv = qkv.view(-1, ng, (g + 2) * hd)
        q = qkv[..., : g * hd].reshape(-1, nq, hd)
        k = qkv[..., g * hd : (g + 1) * hd]
        v = qkv[..., (g + 1) * hd :]
        if spec.qk_layernorm:
            q_in, k_in = q, k
            q, k = self._norm(q, p + "q_layernorm.weight"), self._norm(k, p + "k_layernorm.weight")
            self._record(p + "q_layernorm", q_in, q)
            self._record(p + "k_layernorm", k_in, k)
        angles = rope_angles(positions, self.inv_freq).unsqueeze(1)
        return apply_rope(q, angles, mscale=self.rope_mscale), apply_rope(k, angles, mscale=self.rope_mscale), v

    def _mla_qkv(self, x, p: str, positions):
        """Megatron's MLASelfAttention: queries through their latent (or one projection), keys and
        values up-projected per head from the normed kv latent, the rope channels of the query and
        of the one shared rope key de-interleaved and rotated (cos and sin times YaRN's mscale)."""
        spec = self.spec
        n, dn, dr, dv = spec.num_attention_heads, spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim
        if spec.q_lora_rank is None:
            q = self._linear(x, p + "linear_q_proj.weight")
        else:
            q_latent = self._norm(self._linear(x, p + "linear_q_down_proj.weight"), p + "q_layernorm.weight")
            q = self._linear(q_latent, p + "linear_q_up_proj.weight")
        q = q.view(-1, n, dn + dr)
        kv_latent, k_pe = self._linear(x, p + "linear_kv_down_proj.weight").split([spec.kv_lora_rank, dr], dim=-1)
        kv = self._linear(self._norm(kv_latent, p + "kv_layernorm.weight"), p + "linear_kv_up_proj.weight")
        k_nope, v = kv.view(-1, n, dn + dv).split([dn, dv], dim=-1)
        angles = rope_angles(positions, self.inv_freq).unsqueeze(1)
        q_pe = apply_rope(q[..., dn:], angles, deinterleave=True, mscale=self.rope_mscale)
        k_pe = apply_rope(k_pe.unsqueeze(1), angles, deinterleave=True, mscale=self.rope_mscale)
        q = torch.cat([q[..., :dn], q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, n, -1)], dim=-1)
        return q, k, v.contiguous()

    def _window(self, layer: int):
        """The keys before a query that layer ``layer`` (0-based) sees, or None (full attention): megatron's
        rule on the 1-based layer number, every ``window_attn_skip_freq``-th layer full."""
        spec = self.spec
        skip = spec.window_attn_skip_freq
        if spec.sliding_window is None or (skip is not None and (layer + 1) % skip == 0):
            return None
        return spec.sliding_window - 1

    def _attention(self, x, layer: int, positions, kv_writer, kv_reader, segments):
        spec, prof = self.spec, self.profile
        p = f"decoder.layers.{layer}.self_attention."
        nq, dv = spec.num_attention_heads, spec.value_head_dim
        q, k, v = (self._mla_qkv if spec.multi_latent_attention else self._qkv)(x, p, positions)
        outputs = []
        for seg, (start, stop) in enumerate(segments):
            kv_writer(layer, seg, k[start:stop], v[start:stop])
            # The layer's page pool, this request's pages and its key count (new tokens included):
            # the segment's queries are the request's last positions.
            k_pages, v_pages, table, length = kv_reader(layer, seg)
            ctx = decode_attention(
                q[start:stop].permute(1, 0, 2).unsqueeze(0),
                k_pages,
                v_pages,
                torch.tensor([length], device=q.device),
                table.unsqueeze(0),
                scale=self.scale,
                block_size=prof.attention_block_size,
                row_multiple=prof.gemm_row_multiple,
                split_size=prof.attention_split_size,
                window=self._window(layer),
                sinks=self.w.get(p + "core_attention.softmax_offset"),
            )
            outputs.append(ctx[0].permute(1, 0, 2).reshape(stop - start, nq * dv))
        ctx = torch.cat(outputs)
        self._record(p + "core_attention", q, ctx)
        out = self._row_parallel(ctx, p + "linear_proj.")
        self._record(p + "linear_proj", ctx, out)
        return out

    def forward(self, tokens, positions, segments: List, kv_writer, kv_reader, routing=None) -> torch.Tensor:
        """fp32 logits (rows, padded vocab) for token rows grouped into per-request segments.

        segments: [(start, stop)] row ranges, one per request; kv_writer(layer, seg, k, v) appends
        the segment's keys/values to its request's cache, kv_reader(layer, seg) returns the layer's
        page pools (num_pages, page_size, groups, head_dim) for k and v, the request's page ids in
        order and its key count.
        routing: optional dict filled with each MoE layer's chosen experts per row.
        """
        spec = self.spec
        x = self.w["embedding.word_embeddings.weight"][tokens]
        self._record("embedding", None, x)
        for layer in range(spec.num_layers):
            p = f"decoder.layers.{layer}."
            layer_in = x
            n = self._norm(x, p + "input_layernorm.weight")
            self._record(p + "input_layernorm", x, n)
            attn = self._attention(n, layer, positions, kv_writer, kv_reader, segments)
            self._record(p + "self_attention", n, attn)
            x = x + attn
            h = self._norm(x, p + "pre_mlp_layernorm.weight")
            self._record(p + "pre_mlp_layernorm", x, h)
            if spec.is_moe and layer >= spec.first_k_dense:
                out, idx = self._moe(h, p + "mlp.")
                if routing is not None:
                    routing[layer] = idx
                self._record(p + "mlp.router", h, idx)
            else:
                out = self._mlp(h, p + "mlp.", record=True)
            self._record(p + "mlp", h, out)
            x = x + out
            self._record(f"decoder.layers.{layer}", layer_in, x)
        n = self._norm(x, "decoder.final_layernorm.weight")
        self._record("decoder.final_layernorm", x, n)
        head = "embedding.word_embeddings.weight" if spec.tie_word_embeddings else "output_layer.weight"
        logits = self._linear(n, head, out_dtype=torch.float32)
        self._record("output_layer", n, logits)
        return logits

    def logprob(self, logits: torch.Tensor, target: torch.Tensor, sampling: Optional[Sampling] = None) -> torch.Tensor:
        """Exactly the training side's scoring of ``sampling``'s semantics (default raw): padded
        columns to -inf, fp32 logits divided by T, under processed semantics the columns top-k /
        top-p drop to -inf, then the canonical vocab tree (or, with reduction: rollout_layout, the
        engine's one fp32 log-softmax over the whole vocab)."""
        sampling = sampling or Sampling()
        logits = divide_by_temperature(mask_padded_vocab(logits, self.spec.vocab_size), sampling.scoring_temperature)
        if sampling.masks:
            logits = mask_dropped_vocab(logits, None, self.spec.vocab_size, reference_mask(sampling))
        if self.profile.rollout_layout:
            return full_vocab_logprob(logits, target)
        return vocab_parallel_logprob(logits, target, None, self.profile.canonical_shards,
                                      vocab_size=self.spec.vocab_size, pad_multiple=self.profile.vocab_pad_multiple)

    def score(self, sequences: List[List[int]]) -> List[torch.Tensor]:
        """fp32 logprob of each next token of each sequence (teacher forcing, one prefill per
        sequence): entry t of result i scores sequences[i][t + 1]."""
        out = []
        for seq in sequences:
            tokens = torch.tensor(seq, dtype=torch.long)
            writer, reader = whole_sequence_kv()
            logits = self.forward(tokens, torch.arange(len(seq)), [(0, len(seq))], writer, reader)
            out.append(self.logprob(logits[:-1], tokens[1:]))
        return out


def rope_of(spec: ModelSpec):
    """(inv_freq, the mscale RoPE multiplies cos and sin by, the attention's softmax scale) as megatron
    builds them: GPTModel's RotaryEmbedding and DotProductAttention's 1/sqrt(head), or MLA's own
    RotaryEmbedding / YarnRotaryEmbedding and its m^2/sqrt(head)."""
    if spec.rope_type == "yarn":
        inv_freq = yarn_inv_freq(spec.rotary_dim, spec.rotary_base, spec.rotary_scaling_factor,
                                 spec.original_max_position_embeddings, spec.beta_fast, spec.beta_slow,
                                 spec.correction_range_round_to_int)
        mscale = yarn_mscale(spec.rotary_scaling_factor, spec.mscale, spec.mscale_all_dim)
    if not spec.multi_latent_attention:
        if spec.rope_type == "yarn":  # GPTModel's YarnRotaryEmbedding; the attention's own 1/sqrt(head)
            return inv_freq, mscale, 1.0 / math.sqrt(spec.kv_channels)
        return (rope_inv_freq(spec.rotary_dim, int(spec.rotary_base), spec.rope_scaling_factor), 1.0,
                1.0 / math.sqrt(spec.kv_channels))
    scale = mla_softmax_scale(spec.kv_channels, spec.rotary_scaling_factor, spec.mscale_all_dim)
    if spec.rope_type == "yarn":
        return inv_freq, mscale, scale
    return rope_inv_freq(spec.rotary_dim, spec.rotary_base), 1.0, scale


def whole_sequence_kv():
    """(kv_writer, kv_reader) for a forward of one whole sequence: its keys are one KV page."""
    cache = {}

    def writer(layer, seg, k, v):
        cache[layer] = (k, v)

    def reader(layer, seg):
        k, v = cache[layer]
        return k.unsqueeze(0), v.unsqueeze(0), torch.zeros(1, dtype=torch.long, device=k.device), k.shape[0]

    return writer, reader
