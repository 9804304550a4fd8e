"""vLLM's multi-latent attention on CPU (DeepSeek-V3 / Kimi-K2: vLLM's deepseek_v2.py with its
``CPU_MLA`` backend and ``CPU_SDPA_MLA`` prefill), computed from megatron-core's MLA tensors.

Megatron builds MLA's queries, keys and values non-absorbed: q / kv latents, their norms, the up
projections, RoPE on the rope channels. Under the vllm-cpu profiles those pieces already run the
engine's ops (its GEMMs, its RMSNorm) except three, handled here:
- RoPE: vLLM's ``DeepseekScalingRotaryEmbedding`` (YaRN, its mscale ratio folded into its cos / sin
  cache in the model dtype) rotates interleaved channel pairs where megatron de-interleaves first;
  ``rope`` runs vLLM's own function and returns megatron's channel order (a permutation: exact);
- ``kv_b_proj``: vLLM runs it by ``torch.nn.functional.linear`` (MLA marks it to skip the CPU GEMM
  dispatch): megatron's ``linear_kv_up_proj`` weight is marked so at construction (``models.marks``),
  and the strategy's GEMM reads the mark;
- the attention (``attention``): a prompt is one prefill request (vLLM disables chunked prefill and
  prefix caching for MLA on CPU), ``CPUSDPAMLAPrefillBackend._ragged_sdpa`` on the non-absorbed
  q / k / v (fp32 matmul, causal mask, fp32 softmax, cast); every later position one decode request
  on the latent cache (normed kv latent + roped rope key, blocks of 16): the absorbed query
  ``bmm(q_nope, W_UK_T)``, ``mla_decode_kvcache_cpu``, then ``bmm(., W_UV)``, with vLLM's own views
  of the kv up weight. Its backward is plain attention's (the absorbed form is the same function).

What this relies on, swept in ``tests/test_vllm_kernels.py`` under every ISA limit the host can
emulate (``tests/workers/mla_products_sweep.py``): torch's bf16 ``bmm`` rows do not depend on how many
decode tokens share an engine step, nor on how many heads a call holds (an engine rank's vs a training
rank's), and kv_b_proj's ``F.linear`` rows and columns not on the others. fp32 rows do (the GEMV at one
row): fp32 MLA is refused (``problems``); so do bf16 rows under oneDNN's AVX-512 kernels without BF16
(DeepSeek-V3's 16 heads a rank, one row): the engine family ``avx512`` is refused (``check_host``).
"""
from __future__ import annotations

import functools
from typing import List
from weakref import WeakKeyDictionary

import torch

from ...kernels.collectives import gather_along_rank
from .scoring import current_plan

LATENT_WIDTH, ROPE_WIDTH = 512, 64  # the only cache row mla_decode_kvcache_cpu compiles for (576)
BLOCK_SIZE = 16  # the KV block size vLLM's CPU platform forces for MLA

# core attention module -> (its layer's normed kv latent [s(/tp), b, L], linear_kv_up_proj's weight),
# set by the MLA patch each forward (patches/mla.py)
_latents = WeakKeyDictionary()


def record_latent(core_attention, latent: torch.Tensor, kv_up_weight: torch.Tensor) -> None:
    _latents[core_attention] = (latent.detach(), kv_up_weight)


def problems(model, dtype) -> List[str]:
    """What of a multi-latent attention model (a TransformerConfig or a model spec) vLLM's CPU MLA as
    modelled here does not cover; ``dtype``: the model's (torch dtype or 'bf16' / 'fp32')."""
    out = []
    if str(dtype) not in ("torch.bfloat16", "bf16", "bfloat16"):
        out.append("multi-latent attention in fp32 (the engine's decode bmm rows then depend on how many requests "
                   "share a step: a GEMV at one row)")
    if (model.kv_lora_rank, model.qk_pos_emb_head_dim) != (LATENT_WIDTH, ROPE_WIDTH):
        out.append(f"kv_lora_rank / qk_pos_emb_head_dim = {model.kv_lora_rank} / {model.qk_pos_emb_head_dim} "
                   f"(vLLM's CPU MLA decode kernel runs {LATENT_WIDTH} / {ROPE_WIDTH} only)")
    if getattr(model, "rope_type", "yarn") != "yarn":
        out.append(f"rope_type {model.rope_type!r} with multi-latent attention (modelled: yarn, vLLM's "
                   "DeepseekScalingRotaryEmbedding)")
    if getattr(model, "q_lora_rank", None) is None:
        out.append("multi-latent attention without a query latent (q_lora_rank unset: vLLM's q_proj path is not "
                   "modelled)")
    return out


# Engine kernel families (host.host_isa) whose bf16 bmm is not row-invariant: the engine's own decode
# of a request then depends on how many requests share its step.
ROW_VARIANT_FAMILIES = ("avx512",)


MODELLED_PREFILL = "CPUSDPAMLAPrefillBackend"  # vLLM's CPU prefill; ZenCPUSDPAMLAPrefillBackend (zentorch) is not
MODELLED_ENGINE = f"CPUMLAImpl / {MODELLED_PREFILL}"  # what a started engine reports (kernels.describe_engine_model)


def check_engine(reported) -> None:
    """A started engine's MLA backends (its worker's report; None: no MLA layer) are the modelled ones."""
    if reported is not None and reported != MODELLED_ENGINE:
        from ...contract.refusals import refuse

        raise refuse("vllm_model_shape", what=f"multi-latent attention on the engine's {reported}",
                     engine=f"{MODELLED_ENGINE} modelled", fix="start the engine with AMX hidden and without zentorch")


def check_host() -> None:
    """Before an engine starts and at each MLA forward: this host's engine family decodes MLA the same
    whatever the batch (``ROW_VARIANT_FAMILIES``), and vLLM's own selector picks the modelled prefill."""
    from vllm.platforms import current_platform

    from ...contract.refusals import refuse
    from .host import host_isa

    family = host_isa()
    if family in ROW_VARIANT_FAMILIES:
        raise refuse("vllm_model_shape", what=f"multi-latent attention on a host whose engine kernels are {family!r} "
                     "(its bf16 bmm gives a one-request decode step other bits than a batched one)",
                     engine="no batch-independent MLA decode on this CPU",
                     fix="score this model with the default profile, or on an AVX2 or AVX-512-BF16 host")
    prefill = _prefill_backend(current_platform).__name__
    if prefill != MODELLED_PREFILL:
        raise refuse("vllm_model_shape", what=f"multi-latent attention with vLLM's MLA prefill {prefill}",
                     engine=f"{MODELLED_PREFILL} modelled", fix="uninstall zentorch from the engine's environment")


@functools.lru_cache(maxsize=None)
def _prefill_backend(platform):
    """The MLA prefill class vLLM's platform selects on this host (its selector reads no config on CPU)."""
    return platform.get_mla_prefill_backend_cls(None)


def check(config, profile_name: str) -> None:
    """At each MLA layer's forward: the host and ``problems`` of the model's config, refused by name."""
    check_host()
    check_model(config, config.params_dtype, profile_name)


def check_model(model, dtype, profile_name: str) -> None:
    """``problems`` of a model spec or config refused by name: before the checkers launch
    (check/main.py), at GPTModel construction (the strategy's model_init) and at each MLA forward."""
    found = problems(model, dtype)
    if found:
        from ...contract.refusals import refuse

        raise refuse("multi_latent_attention", setting="profile", value=profile_name,
                     fix="; ".join(found) + ": score it with the default profile")


# ---------------------------------------------------------------- RoPE

@functools.lru_cache(maxsize=8)
def _yarn_cache(rope_dim: int, original_max: int, base: float, factor: float, beta_fast: float,
                beta_slow: float, mscale: float, mscale_all_dim: float, dtype: torch.dtype) -> torch.Tensor:
    """The engine's cos / sin cache: ``DeepseekScalingRotaryEmbedding._compute_cos_sin_cache`` (fp32,
    cos and sin times its mscale ratio), cast to the model dtype as its constructor does."""
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (DeepseekScalingRotaryEmbedding,
                                                                                    yarn_get_mscale)

    rope = object.__new__(DeepseekScalingRotaryEmbedding)  # the cache recipe only; no vLLM config needed
    rope.head_size = rope.rotary_dim = rope_dim
    rope.base, rope.max_position_embeddings = base, original_max
    rope.scaling_factor, rope.beta_fast, rope.beta_slow = factor, beta_fast, beta_slow
    rope.mscale = float(yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(factor, float(mscale_all_dim)))
    return DeepseekScalingRotaryEmbedding._compute_cos_sin_cache(rope).to(dtype)


def rope(t: torch.Tensor, config) -> torch.Tensor:
    """MLA's RoPE on ``t`` [s, b, heads, rope] (checkpoint channel order, positions 0..s-1) as the
    engine computes it, returned in megatron's order (even channels, then odd). Torch ops only:
    autograd differentiates what was computed."""
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

    s, b, h, r = t.shape
    cache = _yarn_cache(r, int(config.original_max_position_embeddings), float(config.rotary_base),
                        float(config.rotary_scaling_factor), float(config.beta_fast), float(config.beta_slow),
                        float(config.mscale), float(config.mscale_all_dim), t.dtype)
    positions = torch.arange(s, device=t.device).repeat_interleave(b)
    x = t.reshape(s * b, h, r)
    out, _ = DeepseekScalingRotaryEmbedding.forward_static(positions, x, x, r, r, cache, False)
    out = out.reshape(s, b, h, r)
    return torch.cat([out[..., 0::2], out[..., 1::2]], dim=-1)


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """Megatron's rope channels (even, then odd) back in the checkpoint's (and the engine's) order."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1).flatten(-2)


# ---------------------------------------------------------------- attention

def engine_scale(config) -> float:
    """vLLM's softmax scale: qk_head_dim ** -0.5 times the square of yarn_get_mscale(factor,
    mscale_all_dim), in its order (DeepseekV2MLAAttention)."""
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import yarn_get_mscale

    scale = (config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5
    m = yarn_get_mscale(float(config.rotary_scaling_factor), float(config.mscale_all_dim))
    return scale * m * m


def _absorbed_weights(kv_up: torch.Tensor, heads: int, nope: int, v_dim: int):
    """vLLM's W_UK_T (heads, nope, L) and W_UV (heads, L, v) as the same views of the kv up weight
    [heads * (nope + v), L] (``split_kv_b_proj``, ``process_weights_after_loading``)."""
    latent = kv_up.shape[-1]
    w = kv_up.detach().T.view(latent, heads, nope + v_dim)
    w_uk, w_uv = w.split([nope, v_dim], dim=-1)
    return w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)


def _prefill(ops_self, q, k, v, prompt_lens):
    """Each sequence's prompt (at least one token: engine_scoring) as one request of ``_ragged_sdpa``
    (q / k / v [b, s, heads, d]) -> each prompt's [p, heads, v] rows."""
    cu = torch.tensor([0] + list(prompt_lens), dtype=torch.int64).cumsum(0)
    out = ops_self._ragged_sdpa(*(torch.cat([t[i, :p] for i, p in enumerate(prompt_lens)]) for t in (q, k, v)),
                                cu, cu, causal=True, return_softmax_lse=False)
    return out.split(list(prompt_lens))


def _decode(q, latent, k_pe, w_uk_t, w_uv, prompt_lens, scale):
    """Every position after each prompt as a decode request over its sequence's latent cache."""
    import vllm._custom_ops as ops

    b, s, h, _ = q.shape
    nope = w_uk_t.shape[1]
    blocks = -(-s // BLOCK_SIZE)
    cache = torch.zeros(b * blocks * BLOCK_SIZE, LATENT_WIDTH + ROPE_WIDTH, dtype=q.dtype)
    cache.view(b, blocks * BLOCK_SIZE, -1)[:, :s] = torch.cat([latent, k_pe], dim=-1)
    cache = cache.view(b * blocks, BLOCK_SIZE, -1)
    seq = torch.cat([torch.full((s - p,), i, dtype=torch.int64) for i, p in enumerate(prompt_lens)])
    pos = torch.cat([torch.arange(p, s) for p in prompt_lens])
    if not len(seq):
        return None
    rows = q[seq, pos]  # (B, heads, nope + rope), token-major as the engine's decode slice of q
    n = rows.shape[0]
    q_nope, q_pe = rows[..., :nope].transpose(0, 1), rows[..., nope:]
    ql_nope = q.new_empty((n, h, LATENT_WIDTH))
    torch.bmm(q_nope, w_uk_t, out=ql_nope.transpose(0, 1))
    query = torch.cat([ql_nope, q_pe], dim=-1).contiguous()
    out = torch.zeros(n, h, LATENT_WIDTH, dtype=q.dtype)
    block_table = torch.arange(b * blocks, dtype=torch.int32).view(b, blocks)[seq].contiguous()
    ops.mla_decode_kvcache_cpu(out, query, cache, scale, block_table, (pos + 1).to(torch.int32))
    context = q.new_empty((n, h, w_uv.shape[-1]))
    torch.bmm(out.transpose(0, 1), w_uv, out=context.transpose(0, 1))
    return seq, pos, context


class _MlaAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, latent, k_pe, kv_up, prompt_lens, scale):
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        b, s, h, _ = q.shape
        v_dim = v.shape[-1]
        prefill = object.__new__(CPUSDPAMLAPrefillBackend)  # _ragged_sdpa reads only its scale
        prefill.scale = scale
        out = q.new_zeros(b, s, h, v_dim)
        for i, rows in enumerate(_prefill(prefill, q.detach(), k.detach(), v.detach(), prompt_lens)):
            out[i, :rows.shape[0]] = rows
        w_uk_t, w_uv = _absorbed_weights(kv_up, h, q.shape[-1] - ROPE_WIDTH, v_dim)
        decoded = _decode(q.detach(), latent, k_pe.detach(), w_uk_t, w_uv, prompt_lens, scale)
        if decoded is not None:
            seq, pos, context = decoded
            out[seq, pos] = context
        return out

    @staticmethod
    def backward(ctx, grad):  # the same function as plain causal attention: its gradient in fp32
        from .kernels import BACKWARD_BLOCK, attention_backward

        q, k, v = ctx.saved_tensors
        dq, dk, dv = attention_backward(q.detach(), k.detach(), v.detach(), grad, ctx.scale, BACKWARD_BLOCK)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def attention(module, query, key, value) -> torch.Tensor:
    """MLA's core attention as the engine computes it: query / key [s, b, heads, nope + rope] (rope
    channels in megatron's order), value [s, b, heads, v] -> [s, b, heads * v]."""
    from ...errors import ConfigError

    found = _latents.get(module)
    if found is None:
        raise ConfigError("vllm-cpu profile: multi-latent attention's latent was not recorded for this layer (its "
                          "MLASelfAttention ran outside the patched get_query_key_value_tensors)")
    latent, kv_up = found
    config = module.config
    sq, b, h, _ = query.shape
    plan = current_plan(b)
    if any(len(plan.chunk_ends(i)) > 1 for i in range(b)):
        from ...contract.refusals import refuse

        raise refuse("vllm_model_shape", what="a chunked prefill of multi-latent attention (a token budget below a "
                     "prompt's length)", engine="whole-prompt MLA prefills (vLLM disables chunked prefill for MLA on "
                     "CPU)", fix="give the engine a token budget of at least the longest prompt")
    if latent.shape[0] != sq:  # sequence parallel: this rank's slice of the sequence
        from megatron.core import parallel_state as ps

        latent = gather_along_rank(latent.contiguous(), ps.get_tensor_model_parallel_group()).flatten(0, 1)
    nope = config.qk_head_dim
    q = torch.cat([query[..., :nope], _interleave(query[..., nope:])], dim=-1).permute(1, 0, 2, 3)
    k = torch.cat([key[..., :nope], _interleave(key[..., nope:])], dim=-1).permute(1, 0, 2, 3)
    v = value.permute(1, 0, 2, 3)
    k_pe = k[:, :, 0, nope:]  # the rope key every head repeats
    out = _MlaAttention.apply(q, k, v, latent.permute(1, 0, 2), k_pe, kv_up, [int(p) for p in plan.prompt_lens],
                              engine_scale(config))
    return out.permute(1, 0, 2, 3).reshape(sq, b, h * value.shape[-1])
