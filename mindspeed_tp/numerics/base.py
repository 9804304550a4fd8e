"""The interface every numerics strategy implements: one method per patched megatron-core piece.

The adapters in ``patches/`` check megatron's arguments (refusing what no strategy models), then
call these with plain tensors and process groups; a strategy never looks anything up globally.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..contract.profile import Profile


def attention_window(module) -> Optional[int]:
    """The left extent of a sliding-window attention layer: megatron-core's ``config.window_size``
    (left, 0) (a query sees itself and the ``left`` keys before it), or None -- also for the layers
    ``window_attn_skip_freq`` leaves full (gpt-oss alternates windowed and full layers), by
    megatron-core's own rule on the layer's global number. Other windows are refused with the config."""
    config = getattr(module, "config", None)
    window = getattr(config, "window_size", None)
    if window is None:
        return None
    skip = getattr(config, "window_attn_skip_freq", None)
    if skip is not None:
        from megatron.core.transformer.utils import is_layer_window_attention  # the lines with the field have it

        if not is_layer_window_attention(window, skip, module.layer_number):
            return None
    return int(window[0])


def attention_sinks(module):
    """The layer's attention sinks (hq_local,), or None: megatron-core's ``softmax_type`` 'learnable'
    (the ``softmax_offset`` parameter, gpt-oss' sinks) or 'off-by-one' (its zeros); 'vanilla' has none."""
    kind = getattr(getattr(module, "config", None), "softmax_type", "vanilla")
    if kind in (None, "vanilla"):
        return None
    return module.softmax_offset


class Numerics:
    """A numerics strategy under one profile (``self.profile``)."""

    name = "abstract"

    def __init__(self, profile: Profile):
        self.profile = profile
        self.row_multiple = profile.gemm_row_multiple

    # ------------------------------------------------------------------ set-up
    def check_ready(self) -> None:
        """At enable(): what the strategy needs is installed (an engine, its kernels)."""

    def model_init(self, original: Callable, model, args: tuple, kwargs: dict) -> None:
        """Before GPTModel.__init__ runs (``original`` with ``args`` / ``kwargs``)."""

    def check_moe_config(self, config) -> None:
        """At MoELayer construction (after the refusal table's MoE rows)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ forward pieces
    def column_linear(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                      sequence_parallel: bool, allreduce_dgrad: bool) -> torch.Tensor:
        """A column-parallel GEMM (QKV, fc1, the LM head) with Megatron's communication."""
        raise NotImplementedError

    def row_linear(self, layer, input_: torch.Tensor, group) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """RowParallelLinear.forward on this rank's K slice: (output, bias Megatron adds later; None
        where the strategy added it)."""
        raise NotImplementedError

    def add_bias(self, x: torch.Tensor, bias: torch.Tensor, sequence_split: bool) -> torch.Tensor:
        """A linear layer's bias added to its output [s, b, n] in the model dtype, as megatron adds a
        skipped bias (MLP's fc1, bias-dropout-add's): one rounded add per element, in any layout.
        sequence_split: the rows are this rank's SP slice (a row-parallel output under SP)."""
        return x + bias

    def mlp_activation(self, x: torch.Tensor, config) -> torch.Tensor:
        """A gated MLP's activation on fc1's output [gate; up] (dense, shared and routed experts) as
        megatron's unfused glu computes it for ``config`` (SwiGLU; gpt-oss' clamped, offset quick-GEGLU),
        every element by one code path (``kernels/elementwise.py``)."""
        from ..contract.model_config import checked_glu
        from ..kernels.elementwise import gated_linear_unit

        # checked at the model's construction; a config changed since is refused here too
        return gated_linear_unit(x, *checked_glu(config))

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """A ConsistentNorm's forward (RMSNorm / LayerNorm, ``module.weight``, ``module.bias``)."""
        raise NotImplementedError

    def rope(self, t: torch.Tensor, freqs: torch.Tensor, config, interleaved: bool,
             cu_seqlens: Optional[torch.Tensor], mscale: float = 1.0) -> torch.Tensor:
        """RoPE on ``t`` with Megatron's angle table ``freqs``; ``config``: the model's; ``mscale``:
        YaRN's concentration factor, cos and sin times it."""
        raise NotImplementedError

    def mla_rope(self, t: torch.Tensor, freqs: torch.Tensor, mscale: float, config) -> torch.Tensor:
        """Multi-latent attention's RoPE: the rope channels de-interleaved (even, then odd), rotated by
        halves, cos and sin times YaRN's ``mscale``; ``config``: the model's."""
        from ..contract.refusals import refuse

        raise refuse("multi_latent_attention", setting="profile", value=self.name,
                     fix="score with a canonical_tree or bitwise_training profile")

    def mla_tensors(self, module, tensors: tuple) -> None:
        """What MLASelfAttention.get_query_key_value_tensors returned for ``module`` this forward
        (megatron-core 0.16+: query, key, value, the normed q latent, the normed kv latent)."""

    def attention(self, module, query, key, value, attention_mask, mask_name: str, causal: bool) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np*hn]."""
        raise NotImplementedError

    def packed_attention(self, module, query, key, value, bounds, causal: bool) -> torch.Tensor:
        """Packed (thd): query [t, np, hn], key/value [t, ng, hn], ``bounds`` the cu_seqlens -> [t, np*hn]."""
        raise NotImplementedError

    # Context parallelism: True when the strategy's attention needs whole sequences of queries (an
    # engine that scores a request as its prefill and decode steps): the CP adapter then gathers the
    # queries too and keeps this rank's rows of the output.
    cp_whole_queries = False

    def check_context_parallel(self, packed: bool = False) -> None:
        """At a CP model's construction and each CP attention call (``packed``: a thd batch): what
        this strategy's CP does not cover is refused here."""

    def cp_gather(self, x: torch.Tensor, total: int, group) -> torch.Tensor:
        """CP, padded: this rank's rows [s_local, ...] -> the whole sequence's [total, ...] in order;
        backward: the row gradients summed over the CP ranks by the collective."""
        from ..kernels.context_parallel import gather_sequence

        return gather_sequence(x, [0, total], group)

    def cp_rope(self, t: torch.Tensor, freqs: torch.Tensor, config, interleaved: bool,
                positions: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
        """Context parallelism, padded (bshd): RoPE of this rank's chunks; ``freqs`` are already their
        angles (Megatron's RotaryEmbedding slices them per CP rank), ``positions`` their absolute
        positions."""
        return self.rope(t, freqs, config, interleaved, None, mscale)

    def cp_attention(self, module, query, key_full, value_full, attention_mask, mask_name: str, causal: bool,
                     q_positions: torch.Tensor) -> torch.Tensor:
        """Context parallelism: this rank's queries [sq_local, b, np, hn] at absolute ``q_positions``
        over the whole sequence's keys/values [S, b, ng, hn] -> [sq_local, b, np*hn]."""
        from ..contract.refusals import refuse

        raise refuse("context_parallel_strategy", strategy=self.name)

    def cp_packed_attention(self, module, query, key_full, value_full, bounds, causal: bool, cp_size: int,
                            cp_rank: int) -> torch.Tensor:
        """Context parallelism, packed (thd): this rank's rows [t_local, np, hn] over the whole packed
        row's keys/values [T, ng, hn] (``bounds`` its cu_seqlens) -> [t_local, np*hn]."""
        from ..contract.refusals import refuse

        raise refuse("context_parallel_strategy", strategy=self.name)

    def residual_add(self, original: Callable, x_with_bias, residual, prob: float, training: bool):
        """Megatron's bias-dropout-add (``original``)."""
        return original(x_with_bias, residual, prob, training)

    def moe(self, layer, hidden_states: torch.Tensor, padding_mask, publish_routing: Callable) -> torch.Tensor:
        """MoELayer.forward's output; ``publish_routing(layer, expert_ids)`` for observers."""
        raise NotImplementedError

    def logprob(self, logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
        """Per-token fp32 logprobs from this rank's vocab shard (``vocab_size``: the true one); while
        ``state.sampling_mask()`` names a ``Sampling`` (processed semantics), over the columns its
        top-k / top-p keep of each full row (``top_k_top_p``)."""
        raise NotImplementedError

    def top_k_top_p(self, rows: torch.Tensor, sampling) -> torch.Tensor:
        """Full real-vocab rows (fp32, already divided by T) with -inf where the engine's top-k /
        top-p drop a column: the engine's own mask, row-local."""
        raise NotImplementedError
