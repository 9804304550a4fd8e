"""The vLLM engine strategy (``vllm-cpu-*`` profiles: ``engine.name: vllm``): the rollout layout
with the installed engine's own kernels for every forward piece (``forward.py`` says what each one
computes and why). Registered in ``numerics.ENGINES`` as ``vllm``."""
from __future__ import annotations

import functools
import inspect

import torch

from ... import compat
from ...contract.refusals import refuse
from ..base import attention_sinks, attention_window
from ..rollout_layout.strategy import RolloutLayout
from . import forward, kernels, mla
from ...contract.model_config import glu_of
from .refusals import (activation_widths, check_activation_widths, check_head_dim, check_partial_rope_dtype,
                       check_swiglu)
from .kernels import engine_partial_linear
from ...models.marks import MLA_KV_UP_ATTR


def _refuse_mscale(mscale: float) -> None:
    if mscale != 1.0:  # model_init refuses YaRN first; a config changed since is refused here
        raise refuse("vllm_model_shape", what=f"RoPE with YaRN's concentration factor {mscale}",
                     engine="RoPE, plain or Llama-3-scaled", fix="position_embedding_type='rope'")


class VllmEngine(RolloutLayout):
    name = "vllm"

    def partial_gemm_for(self, weight):
        """The engine's GEMM on each engine rank's K slice, prepacked once per (parameter, slice)."""
        return functools.partial(engine_partial_linear, source=weight)

    def check_ready(self) -> None:
        """The engine the profile names is installed, on a CPU it was built for."""
        forward.check_ready(self.profile)

    def model_init(self, original, model, args, kwargs) -> None:
        """The engine builds its RoPE cache from the base and max positions."""
        bound = inspect.signature(original).bind(model, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("position_embedding_type", "rope") != "rope" or a.get("seq_len_interpolation_factor") is not None:
            raise refuse("vllm_model_shape", what="RoPE other than rope (plain or Llama-3-scaled, on a head's "
                         "leading channels)", engine="RoPE, plain or Llama-3-scaled, full or partial",
                         fix="position_embedding_type='rope', seq_len_interpolation_factor=None")
        check_partial_rope_dtype(float(a.get("rotary_percent", 1.0)), a["config"].params_dtype)
        head_dim = getattr(a["config"], "kv_channels", None)
        if head_dim:
            check_head_dim(head_dim)
        config = a["config"]
        if getattr(config, "multi_latent_attention", False):
            mla.check_model(config, config.params_dtype, self.profile.name)
        if getattr(config, "pipeline_model_parallel_size", 1) > 1:
            # the stages exchange the residual stream as the engine carries it, fp32 (its unrounded fused-add
            # sum): megatron's schedule sizes its send / recv buffers by the config's pipeline_dtype
            config.pipeline_dtype = torch.float32
        check_swiglu(glu_of(config))
        check_activation_widths(activation_widths(config), self.profile.rollout_tp, config.params_dtype)
        forward.set_rope(a["config"], a.get("rotary_base", 10000), a["max_sequence_length"],
                         a.get("rope_scaling_factor", 8.0) if a.get("rope_scaling", False) else None,
                         float(a.get("rotary_percent", 1.0)))

    def column_gemm(self, x, weight, bias):
        """The engine's GEMM; its logits stay in the model dtype. MLA's kv up projection: the plain
        ``F.linear`` the engine runs for its kv_b_proj (marked at construction)."""
        if getattr(weight, MLA_KV_UP_ATTR, False):
            if bias is not None:
                raise refuse("vllm_model_shape", what="a bias on MLA's kv up projection", engine="none",
                             fix="unset add_bias_linear")
            return torch.nn.functional.linear(x, weight)
        return forward.column_linear(x, weight, bias)

    def norm(self, module, x):
        """The engine's RMSNorm (also of the fp32 fused-add sum)."""
        return forward.norm(x, module.weight, module.eps, module.normalization)

    def rope(self, t, freqs, config, interleaved, cu_seqlens, mscale=1.0):
        """The engine's cos/sin cache (the model's base and max positions) and rotary kernel; packed
        (``cu_seqlens``, t [tokens, heads, dim]): each sequence from its own position 0 (the kernel
        rotates each token at its own position, as the engine's one request at a time)."""
        _refuse_mscale(mscale)
        if cu_seqlens is None:
            return forward.rope(t, config, interleaved)
        bounds = [int(x) for x in cu_seqlens.tolist()]
        positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
        return forward.rope(t.unsqueeze(1), config, interleaved, positions).squeeze(1)

    def mla_tensors(self, module, tensors):
        """The normed kv latent and the kv up weight, for the engine's absorbed decode (``mla.attention``)."""
        if not isinstance(tensors, tuple) or len(tensors) != 5:
            raise refuse("vllm_model_shape", what="multi-latent attention on this megatron-core line (its "
                         "get_query_key_value_tensors returns no kv latent)", engine="vLLM's CPU MLA",
                         fix="use megatron-core 0.16 or later")
        mla.record_latent(module.core_attention, tensors[4], module.linear_kv_up_proj.weight)

    def mla_rope(self, t, freqs, mscale, config):
        """vLLM's DeepSeek YaRN RoPE (its own cos / sin cache; megatron's ``mscale`` is folded in it). The
        model was checked at construction (``model_init``), the host at each MLA attention call."""
        return mla.rope(t, config)

    def attention(self, module, query, key, value, attention_mask, mask_name, causal):
        """The engine's paged attention: prompt prefill, then decode steps (MLA: vLLM's CPU MLA)."""
        if getattr(module.config, "multi_latent_attention", False):
            if not causal:
                raise refuse("vllm_model_shape", what="non-causal attention", engine="causal decoder attention",
                             fix="use attn_mask_type causal")
            mla.check(module.config, self.profile.name)
            return mla.attention(module, query, key, value)
        if getattr(module.config, "window_attn_skip_freq", None) is not None:
            raise refuse("vllm_model_shape", what="alternating windowed and full layers (window_attn_skip_freq)",
                         engine="one window for every layer (Mistral)", fix="unset window_attn_skip_freq")
        if attention_sinks(module) is not None:
            raise refuse("vllm_model_shape", what=f"attention sinks (softmax_type={module.config.softmax_type!r})",
                         engine="no sinks modelled", fix="softmax_type='vanilla'")
        return forward.attention(query, key, value, compat.attention_scale(module), causal, attention_window(module))

    def packed_attention(self, module, query, key, value, bounds, causal):
        """Packed (thd) sequences as the engine's requests: each one padded at its end into a batch row,
        scored by ``attention`` (the scoring plan's prompt lengths, one per packed sequence, in order),
        its real rows taken back. A causal row never reads the padding after it."""
        spans = list(zip(bounds[:-1], bounds[1:]))
        longest = max(b - a for a, b in spans)

        def rows(t):
            padded = t.new_zeros(longest, len(spans), *t.shape[1:])
            for i, (a, b) in enumerate(spans):
                padded[: b - a, i] = t[a:b]
            return padded

        context = self.attention(module, rows(query), rows(key), rows(value), None, "causal", causal)
        return torch.cat([context[: b - a, i] for i, (a, b) in enumerate(spans)], dim=0)

    # Context parallelism: the engine's paged attention scores whole requests (prefill, then decode
    # steps), so every CP rank runs it on the whole sequence and keeps its own chunks' rows.
    cp_whole_queries = True

    def check_context_parallel(self, packed=False):
        """Packed (thd) batches under CP: not modelled (each rank's tokens of a packed sequence would
        need the engine's whole request); refused at the first such attention call."""
        if packed:
            raise refuse("packed_sequences_engine")

    def cp_rope(self, t, freqs, config, interleaved, positions, mscale=1.0):
        """The engine's rotary kernel at this rank's chunk positions."""
        _refuse_mscale(mscale)
        return forward.rope(t, config, interleaved, positions)

    def residual_add(self, original, x_with_bias, residual, prob, training):
        """The residual as the engine's fused-add RMSNorm carries it (fp32, unrounded)."""
        return forward.residual_add(x_with_bias, residual, prob, training)

    def moe(self, layer, hidden_states, padding_mask, publish_routing):
        """The engine's router and fused MoE kernel per engine slice of every expert (split by slice over EP)."""
        return forward.moe(layer, hidden_states, self.profile, publish_routing)

    def log_softmax(self, rows):
        """The engine's sampler log-softmax over the real vocab."""
        return forward.logprob_rows(rows)

    def top_k_top_p(self, rows, sampling):
        """The engine's own top-k / top-p mask (processed logprobs)."""
        return kernels.top_k_top_p(rows, sampling.top_k, sampling.top_p)
