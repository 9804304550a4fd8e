"""Stand-in for flash-attention-npu's v3 package: flash_attn_with_kvcache with the real signature
(paged cache (num_pages, page_size, kv_heads, head_dim)); records calls in CALLS."""
from typing import Optional, Union

import torch

from flash_attn_npu import reference_attention

CALLS = []


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None,
                            cu_seqlens_q: Optional[torch.Tensor] = None,
                            cu_seqlens_k_new: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                            rotary_seqlens: Optional[torch.Tensor] = None, q_descale: Optional[torch.Tensor] = None,
                            k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0, pack_gqa=None,
                            sm_margin=0, return_softmax_lse=False):
    CALLS.append({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": cache_seqlens,
                  "page_table": page_table, "softmax_scale": softmax_scale, "causal": causal,
                  "window_size": window_size, "softcap": softcap, "num_splits": num_splits,
                  "return_softmax_lse": return_softmax_lse, "rotary_cos": rotary_cos, "cache_batch_idx": cache_batch_idx})
    page_size = k_cache.shape[1]
    outs = []
    for i in range(q.shape[0]):
        n = int(cache_seqlens[i])
        pages = page_table[i, : -(-n // page_size)].long()
        keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n].unsqueeze(0)
        values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n].unsqueeze(0)
        outs.append(reference_attention(q[i : i + 1], keys, values, softmax_scale, causal))
    return torch.cat(outs)
