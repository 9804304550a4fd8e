"""Patches of megatron.core attention: one consistent attention function and fp32 RoPE."""
from .. import compat, state
from ..contract import refusals
from ..contract.refusals import refuse
from ..kernels import apply_rope, consistent_attention, dispatch
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


def attention_forward(
    self,
    query,
    key,
    value,
    attention_mask,
    attn_mask_type=None,
    attention_bias=None,
    packed_seq_params=None,
    **kwargs,
):
    """DotProductAttention.forward through ``kernels.consistent_attention``.

    query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np*hn]. GQA is handled
    inside the kernel (no repeat_interleave), and every layout runs the same per-head procedure.
    """
    if packed_seq_params is not None:
        raise refuse("packed_sequences")
    if attention_bias is not None:
        raise refuse("attention_bias")
    _check_attention_config(self)
    prof = state.profile()
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    mask_name = getattr(mask_type, "name", str(mask_type))
    causal = mask_name in _CAUSAL_TYPES
    if prof.engine_name == "vllm":  # the engine's paged attention: prompt prefill, then decode steps
        from ..integrations.vllm import forward as vllm_forward

        return vllm_forward.attention(query, key, value, compat.attention_scale(self), causal)
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


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **kwargs):
    """RoPE in fp32 from Megatron's angle table (absolute positions), one cast at the end."""
    if cu_seqlens is not None:
        raise refuse("packed_rope")
    if getattr(config, "multi_latent_attention", False):
        raise refuse("multi_latent_attention")
    if mscale != 1.0:
        raise refuse("rope_mscale")
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    if state.profile().engine_name == "vllm":  # the engine's cos/sin cache and rotary kernel
        from ..integrations.vllm import forward as vllm_forward

        return vllm_forward.rope(t, interleaved)
    return apply_rope(t, freqs, interleaved=interleaved)


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
