"""Patches of megatron.core attention: one consistent attention function and fp32 RoPE."""
from .. import compat, state
from ..backends import use_npu
from ..errors import ConfigError
from ..integrations.vllm import forward as vllm_forward
from ..kernels import apply_rope, consistent_attention
from ..patching import PatchRegistry

_CAUSAL_TYPES = ("causal", "padding_causal", "causal_bottom_right")


def _check_attention_config(module) -> None:
    config = module.config
    if getattr(config, "apply_query_key_layer_scaling", False):
        raise ConfigError("apply_query_key_layer_scaling must be False with --true-on-policy")
    if getattr(config, "window_size", None) is not None:
        raise ConfigError("window_size (sliding-window attention) is not supported with --true-on-policy")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ConfigError(f"softmax_type={config.softmax_type!r} is not supported; use 'vanilla'")
    if module.training and getattr(config, "attention_dropout", 0.0) > 0:
        raise ConfigError(
            "attention_dropout must be 0 with --true-on-policy (dropout makes the forward random)"
        )


def _npu_mask(mask_name: str, attention_mask):
    """The Ascend flash-attention kernels take causal or no mask, nothing explicit (as MindSpeed's
    flash_attn_npu adaptor): Megatron's mask for attn_mask_type=causal is the kernel's own."""
    if mask_name == "causal":
        return None
    if mask_name == "no_mask" and attention_mask is None:
        return None
    raise ConfigError(f"attn_mask_type={mask_name} with an explicit attention mask is not supported by the npu "
                      f"backend (flash_attn_npu: causal or no_mask only); use attn_mask_type causal")


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
        raise ConfigError("packed sequences (thd format) are not supported with --true-on-policy")
    if attention_bias is not None:
        raise ConfigError("attention_bias is not supported with --true-on-policy")
    _check_attention_config(self)
    prof = state.profile()
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    mask_name = getattr(mask_type, "name", str(mask_type))
    causal = mask_name in _CAUSAL_TYPES
    if vllm_forward.is_vllm(prof):  # the engine's paged attention: prompt prefill, then decode steps
        return vllm_forward.attention(query, key, value, compat.attention_scale(self), causal)
    if use_npu(query):
        attention_mask = _npu_mask(mask_name, attention_mask)
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
        raise ConfigError("packed sequences (thd RoPE) are not supported with --true-on-policy")
    if getattr(config, "multi_latent_attention", False):
        raise ConfigError("multi_latent_attention is not supported with --true-on-policy")
    if mscale != 1.0:
        raise ConfigError("RoPE mscale != 1 (YaRN) is not supported with --true-on-policy")
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    if vllm_forward.is_vllm(state.profile()):  # the engine's cos/sin cache and rotary kernel
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
