"""Adapters of megatron.core attention and RoPE, for padded (bshd) and packed (thd) sequences:
megatron's arguments checked (what no strategy models refused), then the active strategy's
attention and RoPE (by default one consistent attention function and fp32 RoPE)."""
import torch

from .. import compat
from ..contract import refusals
from ..contract.refusals import refuse
from ..numerics import ACTIVE
from ..patching import PatchRegistry
from . import context_parallel, mla

_CAUSAL_TYPES = ("causal", "padding_causal", "causal_bottom_right")


def _check_attention_config(module) -> None:
    config = module.config
    refusals.check_config(refusals.ATTENTION, config)
    if module.training and getattr(config, "attention_dropout", 0.0) > 0:
        raise refuse("attention_dropout")


def packed_boundaries(packed_seq_params, total: int, cp_size: int = 1):
    """cu_seqlens of a packed (thd) batch as a list of ints, after refusing what the consistent
    attention does not model. Sequences may carry padding at their end (verl pads each to a multiple
    of the TP size) as long as the padded and unpadded boundaries agree: a causal pad token is seen
    by no real token of its sequence. Under CP (``cp_size`` > 1) the boundaries are the whole packed
    row's (``total`` * cp_size tokens), each sequence divisible by 2·CP, as Megatron's thd CP batch."""
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
    if local_cp is not None and local_cp > 1:
        raise refuse("context_parallel_hybrid", value=local_cp)
    cp_group = getattr(p, "cp_group", None)
    if cp_group is not None and cp_group.size() != cp_size:
        raise refuse("context_parallel_group", value=cp_group.size(), cp=cp_size)
    if getattr(p, "pad_between_seqs", None):
        raise refuse("packed_pad_between_seqs")
    bounds = [int(x) for x in cu.tolist()]
    total *= cp_size
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise refuse("packed_bad_boundaries", bounds=bounds, total=total)
    if cp_size > 1:
        for a, b in zip(bounds[:-1], bounds[1:]):
            if (b - a) % (2 * cp_size):
                raise refuse("context_parallel_seq_indivisible", seq=b - a, cp=cp_size)
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
    """DotProductAttention.forward through the active strategy.

    query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np*hn]; packed (thd):
    query [t, np, hn], key/value [t, ng, hn] -> [t, np*hn], each sequence on its own.
    """
    if attention_bias is not None:
        raise refuse("attention_bias")
    _check_attention_config(self)
    if getattr(self.config, "multi_latent_attention", False):
        key = mla.shared_rope_key(self, key)
    numerics = ACTIVE.strategy
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    mask_name = getattr(mask_type, "name", str(mask_type))
    causal = mask_name in _CAUSAL_TYPES
    group = context_parallel.cp_group()
    if packed_seq_params is None:
        if group is not None:
            return context_parallel.attention(self, query, key, value, attention_mask, mask_name, causal, group)
        return numerics.attention(self, query, key, value, attention_mask, mask_name, causal)
    if attention_mask is not None:
        raise refuse("packed_explicit_mask")
    if query.dim() == 4:  # [t, 1, np, hn]: a caller that did not squeeze the batch of one
        if query.shape[1] != 1:
            raise refuse("packed_batch", shape=tuple(query.shape))
        query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
    bounds = packed_boundaries(packed_seq_params, query.shape[0], group.size() if group is not None else 1)
    if group is not None:
        return context_parallel.packed_attention(self, query, key, value, bounds, causal, group)
    return numerics.packed_attention(self, query, key, value, bounds, causal)


_UNSET = object()


def _mla_channels(config, mla_rotary_interleaved) -> bool:
    """Whether megatron's RoPE would de-interleave the rotated channels (MLA): megatron-core >= 0.19
    by its ``mla_rotary_interleaved`` argument (None: the config decides), earlier lines by the
    config's multi_latent_attention."""
    if mla_rotary_interleaved is _UNSET:
        return bool(getattr(config, "multi_latent_attention", False)) and not compat.rope_takes_mla_flag()
    if mla_rotary_interleaved is None:
        return bool(getattr(config, "multi_latent_attention", False))
    return bool(mla_rotary_interleaved)


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                         mla_rotary_interleaved=_UNSET):
    """RoPE by the active strategy (fp32 from Megatron's angle table, one cast, by default); packed
    (thd, ``cu_seqlens``): each sequence from its own position 0, as Megatron's thd RoPE. Under CP:
    padded, Megatron's RotaryEmbedding already gave this rank's angles; packed, each sequence's
    chunk positions (``context_parallel.packed_rope``)."""
    if _mla_channels(config, mla_rotary_interleaved):
        if cp_group is not None and cp_group.size() > 1:
            raise refuse("multi_latent_attention", setting="context_parallel_size", value=cp_group.size(),
                         fix="set context_parallel_size=1")
        if cu_seqlens is not None:
            raise refuse("multi_latent_attention", setting="packed sequences (thd)", value="cu_seqlens",
                         fix="pass padded (bshd) batches")
        return ACTIVE.strategy.mla_rope(t, freqs, mscale, config)
    # mscale: YaRN's concentration factor (position_embedding_type yarn), cos and sin times it
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    if cp_group is not None and cp_group.size() > 1:
        if cu_seqlens is not None:
            return context_parallel.packed_rope(t, freqs, config, interleaved, cu_seqlens, cp_group, mscale)
        return context_parallel.padded_rope(t, freqs, config, interleaved, cp_group, mscale)
    return ACTIVE.strategy.rope(t, freqs, config, interleaved, cu_seqlens, mscale)


def register(reg: PatchRegistry) -> None:
    context_parallel.register(reg)
    reg.register(
        "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
        "core attention through one consistent kernel: fixed KV blocks aligned to absolute positions, "
        "fp32 online softmax, masked keys excluded by select",
    )(attention_forward)
    reg.register(
        "megatron.core.transformer.multi_latent_attention:MLASelfAttention.get_query_key_value_tensors",
        "MLA's latent shown to the active strategy (an engine's absorbed decode reads it)", wraps=True,
    )(mla.get_query_key_value_tensors)
    reg.register(
        "megatron.core.models.common.embeddings.rope_utils:apply_rotary_pos_emb",
        "RoPE computed in fp32 with one cast (Megatron casts cos/sin to the activation dtype first)",
    )(apply_rotary_pos_emb)
