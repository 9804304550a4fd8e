"""The canonical-tree strategy (profile ``reduction: canonical_tree``, the default): every sum a
layout splits (a row-parallel K, the vocab, expert-TP) is cut into C fixed leaves folded by one
perfect binary tree, the ranks' subtrees folded by moving data; everything else is row-local and
computed by the batch-invariant kernels (``kernels/``). The backward is the plain one."""
from __future__ import annotations

import torch

from ... import compat, state
from ...contract.refusals import refuse
from ...kernels import moe_dispatch
from ...kernels import (apply_rope, consistent_attention, dispatch, folded_leaf_partials, invariant_linear,
                       packed_attention, vocab_parallel_logprob)
from ...kernels.collectives import fold_across_ranks, group_size
from ...kernels.linear import invariant_linear_values, with_plain_backward
from ...kernels.context_parallel import cp_attention, packed_cp_attention
from ...kernels.norm import affine_norm
from ...kernels.sampling import mask_dropped_vocab, reference_mask
from ..base import Numerics, attention_sinks, attention_window
from .moe_layer import canonical_moe


def mask_for_maskless_kernel(mask_name: str, attention_mask, backend: str):
    """For backends whose attention takes causal or no mask, nothing explicit (the Ascend
    flash-attention kernels, as MindSpeed's flash_attn_npu adaptor): Megatron's mask for
    attn_mask_type=causal is the kernel's own."""
    if mask_name == "causal":
        return None
    if mask_name == "no_mask" and attention_mask is None:
        return None
    raise refuse("explicit_mask_on_maskless_backend", mask=mask_name, backend=backend)


def check_expert_bias(bias, etp_group) -> None:
    """Experts' biases at expert TP 1 only, as megatron-core builds them (its config asserts so): above,
    fc2's bias would be added to copies of a sum only one of which is used."""
    if bias is not None and group_size(etp_group) > 1:
        raise refuse("moe_bias_expert_tp", etp=group_size(etp_group))


class CanonicalTree(Numerics):
    name = "canonical_tree"
    # The backward policy of the invariant GEMMs (kernels.linear): None, the plain GEMMs.
    backward = None

    def check_moe_config(self, config) -> None:
        etp = getattr(config, "expert_tensor_parallel_size", None) or config.tensor_model_parallel_size
        self.profile.check_tp(etp, setting="expert_tensor_parallel_size (--etp)")
        self.check_expert_ffn(config.moe_ffn_hidden_size or config.ffn_hidden_size)

    def check_expert_ffn(self, ffn: int) -> None:
        """K of an expert's fc2 is cut into C canonical leaves."""
        if ffn % self.profile.canonical_shards:
            raise refuse("moe_ffn_indivisible", ffn=ffn, c=self.profile.canonical_shards)

    # ------------------------------------------------------------------ linear layers
    def column_linear(self, input, weight, bias, group, sequence_parallel, allreduce_dgrad):
        if sequence_parallel:
            input = compat.gather_from_sequence_parallel_region(input, group)
        elif allreduce_dgrad:
            input = compat.copy_to_tensor_model_parallel_region(input, group)
        return self.column_gemm(input, weight, bias)

    def column_gemm(self, x, weight, bias):
        """The GEMM on the gathered input: fp32-accumulated, cast once (the LM head: fp32 logits)."""
        out_dtype = torch.float32 if state.want_fp32_output() else x.dtype
        return invariant_linear(x, weight, bias, out_dtype=out_dtype, row_multiple=self.row_multiple,
                                backward=self.backward)

    def row_linear(self, layer, input_, group):
        """The K reduction in canonical tree order: each rank folds its C/TP leaves (K/C columns
        each) in fp32, the ranks' subtrees are folded in rank order by moving data (all-to-all),
        never by the collective library's own sum."""
        prof = self.profile
        if layer.input_size % prof.canonical_shards:
            raise refuse("row_k_indivisible", k=layer.input_size, cls=type(layer).__name__, c=prof.canonical_shards)
        lead = input_.shape[:-1]
        x2d = input_.reshape(-1, input_.shape[-1])
        leaves = prof.canonical_shards // group_size(group)
        partial = folded_leaf_partials(x2d, layer.weight, leaves, self.row_multiple, backward=self.backward)
        partial = partial.reshape(*lead, partial.shape[-1])
        output_ = fold_across_ranks(partial, group, input_.dtype, scatter_dim0=bool(layer.sequence_parallel))
        if layer.bias is not None:
            # after the fold, in the model dtype, whether or not megatron skips the add (skip_bias_add: its
            # bias-dropout-add would add it, possibly compiled with the residual add in one rounding)
            output_ = self.add_bias(output_, layer.bias, sequence_split=bool(layer.sequence_parallel))
        return output_, None

    # ------------------------------------------------------------------ MoE pieces (numerics/canonical/moe_layer.py)
    def router_logits(self, h, weight, bias, config):
        """fp32 router logits by the invariant GEMM, the router's bias (gpt-oss) added in fp32 (megatron's
        addmm); plain backward."""
        return invariant_linear(h, weight, bias, out_dtype=torch.float32, row_multiple=self.row_multiple)

    def router_losses(self, router, logits, padding_mask):
        """megatron's ``router.routing`` on our logits: its probabilities, its losses attached."""
        kwargs = {} if padding_mask is None else {"padding_mask": padding_mask}
        return router.routing(logits, **kwargs)[0]

    def moe_dispatch(self, h, plan, group, k):
        """Token rows -> each local expert's rows (``kernels.moe_dispatch``), autograd's backward."""
        return moe_dispatch.dispatch(h, plan, group)

    def expert_rows(self, plan, group, experts):
        """Per local expert, what the strategy's expert GEMMs need to know of their rows (none here)."""
        return [None] * len(experts)

    def expert_up_projs(self, xs, weights, biases, etp_group, gated, rows):
        """Every local expert's ``expert_up_proj``, their forward GEMMs computed together
        (``invariant_linear_values``: shared tiles, each product's bits unchanged)."""
        products = invariant_linear_values(xs, weights, row_multiple=self.row_multiple)
        return [self.expert_up_proj(x, w, b, etp_group, gated, r, product)
                for x, w, b, r, product in zip(xs, weights, biases, rows, products)]

    def expert_up_proj(self, x, weight, bias, etp_group, gated, rows, product=None):
        """An expert's fc1 shard on its rows by the invariant GEMM (``product``: its value, computed
        already), then its bias slice (gpt-oss) added in the model dtype, as megatron's expert MLP adds it."""
        if product is None:
            out = invariant_linear(x, weight, row_multiple=self.row_multiple)
        else:
            out = with_plain_backward(x, weight, lambda a, w: product)
        return out if bias is None else out + bias

    def expert_down_projs(self, acts, weights, biases, etp_group, dtypes, rows):
        """Every local expert's ``expert_down_proj`` (a strategy may compute them together)."""
        return [self.expert_down_proj(a, w, b, etp_group, d, r)
                for a, w, b, d, r in zip(acts, weights, biases, dtypes, rows)]

    def expert_down_proj(self, a, weight, bias, etp_group, dtype, rows):
        """An expert's fc2 on its rows: leaves folded across expert TP, then its bias added in the model
        dtype; only one expert-TP rank's copy goes back to the token (``moe_layer``)."""
        check_expert_bias(bias, etp_group)
        leaves = self.profile.canonical_shards // group_size(etp_group)
        partial = folded_leaf_partials(a, weight, leaves, self.row_multiple)
        out = fold_across_ranks(partial, etp_group, dtype, replicated_output=False)
        return out if bias is None else out + bias

    # ------------------------------------------------------------------ per-token pieces
    def norm(self, module, x):
        return affine_norm(x, module.weight, module.bias, module.eps, module.normalization)

    def rope(self, t, freqs, config, interleaved, cu_seqlens, mscale=1.0):
        """RoPE in fp32 from Megatron's angle table (absolute positions), cos and sin times YaRN's
        ``mscale``, one cast at the end; packed (``cu_seqlens``): each sequence from its own position
        0, as Megatron's thd RoPE."""
        if cu_seqlens is None:
            return apply_rope(t, freqs, interleaved=interleaved, mscale=mscale)
        bounds = [int(x) for x in cu_seqlens.tolist()]
        parts = [apply_rope(t[a:b].unsqueeze(1), freqs[: b - a], interleaved=interleaved, mscale=mscale).squeeze(1)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(parts, dim=0) if parts else t

    def mla_rope(self, t, freqs, mscale, config):
        return apply_rope(t, freqs, deinterleave=True, mscale=mscale)

    def attention(self, module, query, key, value, attention_mask, mask_name, causal):
        """``kernels.consistent_attention``: GQA inside the kernel (no repeat_interleave), fixed KV
        blocks aligned to absolute positions."""
        prof = self.profile
        if attention_mask is not None and attention_mask.dim() != 4:
            raise refuse("padding_mask_2d", shape=tuple(attention_mask.shape))
        if not dispatch.backend_attribute(query, "EXPLICIT_MASKS", True):
            attention_mask = mask_for_maskless_kernel(mask_name, attention_mask, dispatch.backend_name(query))
        sq, b, np_ = query.shape[:3]
        context = consistent_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            scale=compat.attention_scale(module), causal=causal, excluded=attention_mask,
            block_size=prof.attention_block_size, row_multiple=prof.gemm_row_multiple,
            split_size=prof.attention_split_size, window=attention_window(module), sinks=attention_sinks(module),
        )
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * context.shape[-1])

    def packed_attention(self, module, query, key, value, bounds, causal):
        prof = self.profile
        context = packed_attention(query, key, value, bounds, scale=compat.attention_scale(module), causal=causal,
                                   block_size=prof.attention_block_size, row_multiple=prof.gemm_row_multiple,
                                   split_size=prof.attention_split_size, window=attention_window(module),
                                   sinks=attention_sinks(module))
        return context.reshape(context.shape[0], -1)

    def cp_attention(self, module, query, key_full, value_full, attention_mask, mask_name, causal, q_positions):
        """The same kernel per query at its absolute position over the whole sequence's keys
        (``kernels.context_parallel``): the one-device bits."""
        prof = self.profile
        if attention_mask is not None and not dispatch.backend_attribute(query, "EXPLICIT_MASKS", True):
            attention_mask = mask_for_maskless_kernel(mask_name, attention_mask, dispatch.backend_name(query))
        sq, b, np_ = query.shape[:3]
        context = cp_attention(
            query.permute(1, 2, 0, 3), key_full.permute(1, 2, 0, 3), value_full.permute(1, 2, 0, 3),
            compat.attention_scale(module), causal, q_positions, attention_mask, prof.attention_block_size,
            prof.gemm_row_multiple, prof.attention_split_size, attention_window(module),
        )
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * context.shape[-1])

    def cp_packed_attention(self, module, query, key_full, value_full, bounds, causal, cp_size, cp_rank):
        prof = self.profile
        context = packed_cp_attention(query, key_full, value_full, bounds, cp_size, cp_rank,
                                      compat.attention_scale(module), causal, prof.attention_block_size,
                                      prof.gemm_row_multiple, prof.attention_split_size, attention_window(module))
        return context.reshape(context.shape[0], -1)

    # ------------------------------------------------------------------ MoE and logprobs
    def moe(self, layer, hidden_states, padding_mask, publish_routing):
        return canonical_moe(self, layer, hidden_states, padding_mask, publish_routing)

    def top_k_top_p(self, rows, sampling):
        """Full real-vocab rows (fp32, divided by T) with -inf where the engine's top-k / top-p drop
        a column (processed logprobs): the reference engine's mask (``kernels.sampling``)."""
        return reference_mask(sampling)(rows)

    def logprob(self, logits, target, group, vocab_size):
        """The canonical vocab tree in fp32 (``kernels.logprob``); under processed semantics over the
        columns the full row's top-k / top-p keep (the others exactly 0)."""
        sampling = state.sampling_mask()
        if sampling is not None:
            logits = mask_dropped_vocab(logits.float(), group, vocab_size or logits.shape[-1] * group_size(group),
                                        lambda rows: self.top_k_top_p(rows, sampling))
        return vocab_parallel_logprob(logits, target, group, self.profile.canonical_shards,
                                      vocab_size=vocab_size, pad_multiple=self.profile.vocab_pad_multiple)
