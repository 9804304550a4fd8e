"""Stand-in for flash-attention-npu's ``flash_attn_npu`` (v2) package: flash_attn_func with the
real signature; records calls in CALLS and returns plain-torch attention (bottom-right causal)."""
import math

import torch

CALLS = []


def reference_attention(q, k, v, softmax_scale, causal):
    """q (b, sq, hq, d), k/v (b, sk, hkv, d) -> (b, sq, hq, d); GQA; causal bottom-right aligned."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kk = k.float().repeat_interleave(hq // hkv, dim=2)
    vv = v.float().repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    if causal:
        qpos = torch.arange(sk - sq, sk).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(sk).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vv).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    CALLS.append({"q": q, "k": k, "v": v, "dropout_p": dropout_p, "softmax_scale": softmax_scale, "causal": causal,
                  "window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes,
                  "deterministic": deterministic, "return_attn_probs": return_attn_probs})
    return reference_attention(q, k, v, softmax_scale, causal)
