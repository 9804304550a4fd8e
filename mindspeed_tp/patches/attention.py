"""Patches of megatron.core attention: one consistent attention function and fp32 RoPE, for
padded (bshd) and packed (thd) sequences."""
import torch

from .. import compat, state
from ..contract import refusals
from ..contract.refusals import refuse
from ..kernels import apply_rope, consistent_attention, dispatch, packed_attention
from ..patching import PatchRegistry

_CAUSAL_TYPES = ("causal", "padding_causal", "causal_bottom_right")


def _check_attention_config(module) -> None:
    config = module.config
    refusals.check_config(refusals.ATTENTION, config)
    if module.training and getattr(config, "attention_dropout", 0.0) > 0:
        raise refuse("attention_dropout")


def _mask_for_maskless_kernel(mask_name: str, attention_mask, backend: str):
    """For backends whose attention takes causal or no mask, nothing explicit (the Ascend
    flash-attention kernels, as MindSpeed's flash_attn_npu adaptor): Megatron's mask for
    attn_mask_type=causal is the kernel's own."""
    if mask_name == "causal":
        return None
    if mask_name == "no_mask" and attention_mask is None:
        return None
    raise refuse("explicit_mask_on_maskless_backend", mask=mask_name, backend=backend)


def packed_boundaries(packed_seq_params, total: int):
    """cu_seqlens of a packed (thd) batch as a list of ints, after refusing what the consistent
    attention does not model. Sequences may carry padding at their end (verl pads each to a multiple
    of the TP size) as long as the padded and unpadded boundaries agree: a causal pad token is seen
    by no real token of its sequence."""
    p = packed_seq_params
    fmt = getattr(p, "qkv_format", None)
    if fmt != "thd":
        raise refuse("packed_qkv_format", value=fmt)
    cu = p.cu_seqlens_q
    if cu is None:
        raise refuse("packed_without_cu_seqlens")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(p, name, None)
        if other is not None and not torch.equal(other.to(cu.device, cu.dtype), cu):
            raise refuse("packed_boundaries_differ", name=name)
    local_cp = getattr(p, "local_cp_size", None)
    cp_group = getattr(p, "cp_group", None)
    if (local_cp is not None and local_cp > 1) or (cp_group is not None and cp_group.size() > 1):
        raise refuse("context_parallel")
    if getattr(p, "pad_between_seqs", None):
        raise refuse("packed_pad_between_seqs")
    bounds = [int(x) for x in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise refuse("packed_bad_boundaries", bounds=bounds, total=total)
    return bounds


def attention_forward(
    self,
    query,
    key,
    value,
    attention_mask,
    attn_mask_type=None,
    attention_bias=None,
    packed_seq_params=None,
):
    """DotProductAttention.forward through ``kernels.consistent_attention``.

    query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np*hn]; packed (thd):
    query [t, np, hn], key/value [t, ng, hn] -> [t, np*hn], each sequence on its own
    (``kernels.packed_attention``). GQA is handled inside the kernel (no repeat_interleave), and
    every layout runs the same per-head procedure.
    """
    if attention_bias is not None:
        raise refuse("attention_bias")
    _check_attention_config(self)
    prof = state.profile()
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    mask_name = getattr(mask_type, "name", str(mask_type))
    causal = mask_name in _CAUSAL_TYPES
    if packed_seq_params is not None:
        if prof.engine_name == "vllm":
            raise refuse("packed_sequences_engine")
        return _packed_forward(self, query, key, value, attention_mask, packed_seq_params, causal, prof)
    if prof.engine_name == "vllm":  # the engine's paged attention: prompt prefill, then decode steps
        from ..integrations.vllm import forward as vllm_forward

        return vllm_forward.attention(query, key, value, compat.attention_scale(self), causal)
    if attention_mask is not None and attention_mask.dim() != 4:
        raise refuse("padding_mask_2d", shape=tuple(attention_mask.shape))
    if not dispatch.backend_attribute(query, "EXPLICIT_MASKS", True):
        attention_mask = _mask_for_maskless_kernel(mask_name, attention_mask, dispatch.backend_name(query))
    sq, b, np_, hn = query.shape
    q = query.permute(1, 2, 0, 3)
    k = key.permute(1, 2, 0, 3)
    v = value.permute(1, 2, 0, 3)
    context = consistent_attention(
        q,
        k,
        v,
        scale=compat.attention_scale(self),
        causal=causal,
        excluded=attention_mask,
        block_size=prof.attention_block_size,
        row_multiple=prof.gemm_row_multiple,
        split_size=prof.attention_split_size,
    )
    return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def _packed_forward(self, query, key, value, attention_mask, packed_seq_params, causal, prof):
    if attention_mask is not None:
        raise refuse("packed_explicit_mask")
    if query.dim() == 4:  # [t, 1, np, hn]: a caller that did not squeeze the batch of one
        if query.shape[1] != 1:
            raise refuse("packed_batch", shape=tuple(query.shape))
        query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
    bounds = packed_boundaries(packed_seq_params, query.shape[0])
    context = packed_attention(query, key, value, bounds, scale=compat.attention_scale(self), causal=causal,
                               block_size=prof.attention_block_size, row_multiple=prof.gemm_row_multiple,
                               split_size=prof.attention_split_size)
    return context.reshape(context.shape[0], -1)


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                         mla_rotary_interleaved=False):
    """RoPE in fp32 from Megatron's angle table (absolute positions), one cast at the end; packed
    (thd, ``cu_seqlens``): each sequence from its own position 0, as Megatron's thd RoPE."""
    if getattr(config, "multi_latent_attention", False) or mla_rotary_interleaved:
        raise refuse("multi_latent_attention")
    if mscale != 1.0:
        raise refuse("rope_mscale")
    if cp_group is not None and cp_group.size() > 1:
        raise refuse("context_parallel")
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    if state.profile().engine_name == "vllm":  # the engine's cos/sin cache and rotary kernel
        if cu_seqlens is not None:
            raise refuse("packed_sequences_engine")
        from ..integrations.vllm import forward as vllm_forward

        return vllm_forward.rope(t, interleaved)
    if cu_seqlens is None:
        return apply_rope(t, freqs, interleaved=interleaved)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    parts = [apply_rope(t[a:b].unsqueeze(1), freqs[: b - a], interleaved=interleaved).squeeze(1)
             for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=0) if parts else t


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
        "core attention through one consistent kernel: fixed KV blocks aligned to absolute positions, "
        "fp32 online softmax, masked keys excluded by select",
    )(attention_forward)
    reg.register(
        "megatron.core.models.common.embeddings.rope_utils:apply_rotary_pos_emb",
        "RoPE computed in fp32 with one cast (Megatron casts cos/sin to the activation dtype first)",
    )(apply_rotary_pos_emb)
