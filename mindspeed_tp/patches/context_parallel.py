"""Context parallelism in the local-spec attention (``kernels/context_parallel.py`` says how).

megatron-core's DotProductAttention asserts CP = 1 (its CP lives in Transformer Engine); with the
patches on, its constructor accepts CP and the patched forward exchanges keys/values over the CP
group. RoPE: for padded (bshd) batches Megatron's RotaryEmbedding already hands each rank the
angles of its chunks; for packed (thd) ones the adapter picks each sequence's chunk positions.
"""
from __future__ import annotations

import copy
import functools
import inspect

import torch

from ..contract.model_config import CP_COMM_TYPES
from ..contract.refusals import refuse
from ..kernels import context_parallel as cp
from ..numerics import ACTIVE
from ..numerics.base import attention_sinks
from ..patching import PatchRegistry


def cp_group():
    """Megatron's context-parallel group, or None at CP = 1 (or before the parallel state exists)."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group if group is not None and group.size() > 1 else None


@functools.lru_cache(maxsize=None)
def _local_attention_windows() -> bool:
    """Whether this line's local DotProductAttention takes a window_size (0.12 asserts it is None)."""
    from megatron.core.transformer import dot_product_attention

    return hasattr(dot_product_attention, "is_layer_window_attention")  # what it windows layers by


def check_modes(packed: bool = False) -> None:
    """What the active strategy's CP does not cover yet, refused by name (the strategy decides)."""
    ACTIVE.strategy.check_context_parallel(packed)


def attention_init(original):
    """DotProductAttention.__init__ on a CP model: megatron's local attention asserts CP = 1; it is
    built from a copy of the config with CP = 1 (nothing it computes at construction depends on
    CP), then keeps the real config. The same for a sliding window on the lines whose local
    attention asserts ``window_size`` is None (megatron-core 0.12; the patched forward applies it)."""

    def __init__(self, config, *args, **kwargs):
        local = config
        if getattr(config, "context_parallel_size", 1) > 1:
            check_modes()  # at model construction, before any batch
            bound = inspect.signature(original).bind(self, config, *args, **kwargs)
            cp_type = bound.arguments.get("cp_comm_type")
            if cp_type not in CP_COMM_TYPES:
                raise refuse("context_parallel_comm_type", value=cp_type)
            local = copy.copy(config)
            local.context_parallel_size = 1
        if getattr(config, "window_size", None) is not None and not _local_attention_windows():
            local = copy.copy(local)
            local.window_size = None
        original(self, local, *args, **kwargs)
        self.config = config
        _mark_sinks_tensor_parallel(self)

    return __init__


def _mark_sinks_tensor_parallel(module) -> None:
    """megatron-core builds the learnable sinks (``softmax_offset``, one per local head) without the
    tensor-parallel attributes its other head-split parameters carry, so the gradient norm and the
    clipping count TP rank 0's sinks only (every rank's are distinct): marked as split along dim 0."""
    sinks = getattr(module, "softmax_offset", None)
    if isinstance(sinks, torch.nn.Parameter) and not getattr(sinks, "tensor_model_parallel", False):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(sinks, True, 0, 1)


def _local_mask(attention_mask, sq: int, sk: int):
    """Megatron's CP batch slices a [b, 1, s, s] mask by query rows: [b, 1, sq_local, S]."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[-2] not in (1, sq) or attention_mask.shape[-1] != sk:
        raise refuse("context_parallel_mask", shape=tuple(attention_mask.shape), sq=sq, sk=sk)
    return attention_mask


def _refuse_sinks(module) -> None:
    if attention_sinks(module) is not None:
        raise refuse("attention_sinks_cp", value=module.config.softmax_type)


def attention(module, query, key, value, attention_mask, mask_name: str, causal: bool, group):
    """query [sq_local, b, np, hn] (this rank's two chunks), key/value likewise -> [sq_local, b, np*hn]."""
    check_modes()
    _refuse_sinks(module)
    size, rank = group.size(), group.rank()
    sq_local = query.shape[0]
    total = sq_local * size
    if key.shape[0] != sq_local:
        raise refuse("context_parallel_mask", shape=tuple(key.shape), sq=sq_local, sk=total)
    strategy = ACTIVE.strategy
    key_full = strategy.cp_gather(key, total, group)
    value_full = strategy.cp_gather(value, total, group)
    positions = cp.local_positions(total, size, rank, device=query.device)
    mask = _local_mask(attention_mask, sq_local, total)
    if strategy.cp_whole_queries:  # the strategy scores whole sequences: keep this rank's rows
        if mask_name != "causal":
            raise refuse("context_parallel_mask", shape=tuple(attention_mask.shape) if attention_mask is not None
                         else None, sq=sq_local, sk=total)
        query_full = strategy.cp_gather(query, total, group)
        out = strategy.attention(module, query_full, key_full, value_full, None, mask_name, causal)
        return out.index_select(0, positions)
    return strategy.cp_attention(module, query, key_full, value_full, mask, mask_name, causal, positions)


def packed_attention(module, query, key, value, bounds, causal: bool, group):
    """Packed (thd): query/key/value [t_local, heads, hn] -> [t_local, np*hn]; bounds: the whole
    packed row's cu_seqlens (Megatron's convention under CP)."""
    check_modes(packed=True)
    _refuse_sinks(module)
    key_full = cp.gather_sequence(key, bounds, group)
    value_full = cp.gather_sequence(value, bounds, group)
    return ACTIVE.strategy.cp_packed_attention(module, query, key_full, value_full, bounds, causal,
                                               group.size(), group.rank())


def padded_rope(t, freqs, config, interleaved: bool, group, mscale: float = 1.0):
    """bshd RoPE under CP: ``freqs`` are this rank's chunks' angles already (Megatron's
    RotaryEmbedding); the strategy also gets their absolute positions."""
    positions = cp.local_positions(t.shape[0] * group.size(), group.size(), group.rank(), device=t.device)
    return ACTIVE.strategy.cp_rope(t, freqs, config, interleaved, positions, mscale)


def packed_rope(t, freqs, config, interleaved: bool, cu_seqlens, group, mscale: float = 1.0):
    """thd RoPE under CP: each sequence's local tokens at their own positions (Megatron's
    ``_get_thd_freqs_on_this_cp_rank``), by the strategy's RoPE of per-token angles."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for a, b in zip(bounds[:-1], bounds[1:]):
        if (b - a) % (2 * group.size()):
            raise refuse("context_parallel_seq_indivisible", seq=b - a, cp=group.size())
    positions = torch.cat(cp.packed_local_positions(bounds, group.size(), group.rank()) or
                          [torch.zeros(0, dtype=torch.long)]).to(freqs.device)
    if positions.numel() != t.shape[0]:
        raise refuse("packed_bad_boundaries", bounds=bounds, total=t.shape[0] * group.size())
    # one packed row as [t, 1, heads, dim] with one angle row per token: the padded RoPE path
    return ACTIVE.strategy.rope(t.unsqueeze(1), freqs[positions], config, interleaved, None, mscale).squeeze(1)


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
        "accepts context_parallel_size > 1 (megatron-core's local attention asserts CP = 1; the patched "
        "forward exchanges keys/values over the CP group); marks learnable sinks as split over TP",
        wraps=True,
    )(attention_init)
