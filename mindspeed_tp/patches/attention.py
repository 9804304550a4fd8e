"""Patches of megatron.core attention: one consistent attention function and fp32 RoPE."""
from .. import compat, state
from ..backends import use_npu
from ..errors import ConfigError
import torch

from ..kernels import apply_rope, consistent_attention, packed_attention
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


def packed_boundaries(packed_seq_params, total: int):
    """cu_seqlens of a packed (thd) batch as a list of ints, after refusing what the consistent
    attention does not model. Sequences may carry padding at their end (verl pads each to a multiple
    of the TP size) as long as the padded and unpadded boundaries agree: a causal pad token is seen
    by no real token of its sequence."""
    p = packed_seq_params
    fmt = getattr(p, "qkv_format", None)
    if fmt != "thd":
        raise ConfigError(f"packed_seq_params.qkv_format={fmt!r} is not supported with --true-on-policy; use 'thd'")
    cu = p.cu_seqlens_q
    if cu is None:
        raise ConfigError("packed_seq_params.cu_seqlens_q is required for packed (thd) sequences")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(p, name, None)
        if other is not None and not torch.equal(other.to(cu.device, cu.dtype), cu):
            raise ConfigError(f"packed_seq_params.{name} differs from cu_seqlens_q: padding between packed sequences "
                              f"(or separate key boundaries) is not supported with --true-on-policy; pad each "
                              f"sequence at its end and give one set of boundaries")
    local_cp = getattr(p, "local_cp_size", None)
    cp_group = getattr(p, "cp_group", None)
    if (local_cp is not None and local_cp > 1) or (cp_group is not None and cp_group.size() > 1):
        raise ConfigError("context parallelism with packed sequences is not supported with --true-on-policy; "
                          "set context_parallel_size=1")
    if getattr(p, "pad_between_seqs", None):
        raise ConfigError("packed_seq_params.pad_between_seqs is not supported with --true-on-policy")
    bounds = [int(x) for x in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ConfigError(f"packed_seq_params.cu_seqlens_q={bounds} must rise from 0 to the packed length {total}")
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
        raise ConfigError("attention_bias is not supported with --true-on-policy")
    _check_attention_config(self)
    prof = state.profile()
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    mask_name = getattr(mask_type, "name", str(mask_type))
    causal = mask_name in _CAUSAL_TYPES
    if packed_seq_params is not None:
        return _packed_forward(self, query, key, value, attention_mask, packed_seq_params, causal, prof)
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ConfigError(
            f"attention_mask of shape {tuple(attention_mask.shape)}: the patched attention takes Megatron's "
            f"[b, 1, sq, sk] mask (True hides a key); a [b, s] padding mask (verl's bshd engine path, "
            f"use_remove_padding=False) is not supported -- use packed sequences (use_remove_padding=True)"
        )
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


def _packed_forward(self, query, key, value, attention_mask, packed_seq_params, causal, prof):
    if attention_mask is not None:
        raise ConfigError("an explicit attention_mask with packed (thd) sequences is not supported with "
                          "--true-on-policy: the boundaries in cu_seqlens are the mask")
    if query.dim() == 4:  # [t, 1, np, hn]: a caller that did not squeeze the batch of one
        if query.shape[1] != 1:
            raise ConfigError(f"packed (thd) query of shape {tuple(query.shape)}: expected one packed row")
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
        raise ConfigError("multi_latent_attention is not supported with --true-on-policy")
    if mscale != 1.0:
        raise ConfigError("RoPE mscale != 1 (YaRN) is not supported with --true-on-policy")
    if cp_group is not None and cp_group.size() > 1:
        raise ConfigError("context parallelism is not supported with --true-on-policy; set context_parallel_size=1")
    interleaved = bool(getattr(config, "rotary_interleaved", False))
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
