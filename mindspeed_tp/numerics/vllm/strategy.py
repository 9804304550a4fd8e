"""The vLLM engine strategy (``vllm-cpu-*`` profiles: ``engine.name: vllm``): the rollout layout
with the installed engine's own kernels for every forward piece (``forward.py`` says what each one
computes and why). Registered in ``numerics.ENGINES`` as ``vllm``."""
from __future__ import annotations

import functools
import inspect

from ... import compat
from ...contract.refusals import refuse
from ..base import attention_sinks, attention_window
from ..rollout_layout.strategy import RolloutLayout
from . import forward, kernels
from ...contract.model_config import glu_of
from .refusals import (activation_widths, check_activation_widths, check_head_dim, check_partial_rope_dtype,
                       check_swiglu)
from .kernels import engine_partial_linear


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
        check_swiglu(glu_of(config))
        check_activation_widths(activation_widths(config), self.profile.rollout_tp, config.params_dtype)
        forward.set_rope(a["config"], a.get("rotary_base", 10000), a["max_sequence_length"],
                         a.get("rope_scaling_factor", 8.0) if a.get("rope_scaling", False) else None,
                         float(a.get("rotary_percent", 1.0)))

    def column_gemm(self, x, weight, bias):
        """The engine's GEMM; its logits stay in the model dtype."""
        return forward.column_linear(x, weight, bias)

    def norm(self, module, x):
        """The engine's RMSNorm (also of the fp32 fused-add sum)."""
        return forward.norm(x, module.weight, module.eps, module.normalization)

    def rope(self, t, freqs, config, interleaved, cu_seqlens, mscale=1.0):
        """The engine's cos/sin cache (the model's base and max positions) and rotary kernel."""
        if cu_seqlens is not None:
            raise refuse("packed_sequences_engine")
        _refuse_mscale(mscale)
        return forward.rope(t, config, interleaved)

    def attention(self, module, query, key, value, attention_mask, mask_name, causal):
        """The engine's paged attention: prompt prefill, then decode steps."""
        if getattr(module.config, "window_attn_skip_freq", None) is not None:
            raise refuse("vllm_model_shape", what="alternating windowed and full layers (window_attn_skip_freq)",
                         engine="one window for every layer (Mistral)", fix="unset window_attn_skip_freq")
        if attention_sinks(module) is not None:
            raise refuse("vllm_model_shape", what=f"attention sinks (softmax_type={module.config.softmax_type!r})",
                         engine="no sinks modelled", fix="softmax_type='vanilla'")
        return forward.attention(query, key, value, compat.attention_scale(module), causal, attention_window(module))

    def packed_attention(self, module, query, key, value, bounds, causal):
        raise refuse("packed_sequences_engine")

    # Context parallelism: the engine's paged attention scores whole requests (prefill, then decode
    # steps), so every CP rank runs it on the whole sequence and keeps its own chunks' rows.
    cp_whole_queries = True

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
