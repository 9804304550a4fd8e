"""The patched Megatron forward under a ``vllm-cpu-*`` profile: each patched megatron-core piece
computes what the engine's Qwen3 / Qwen3-MoE / Qwen2 / Llama model computes at TP=R (vllm/model_executor/
models/qwen3.py, qwen3_moe.py, qwen2.py, llama.py, mistral.py: one decoder, the QK-norm, the QKV bias,
Llama-3's RoPE cache and Mistral's sliding window per family), through the engine's own ops (``kernels``).

Operator order the engine uses and Megatron does not, and how it is reproduced:
- residual stream: the engine's fused-add RMSNorm adds a layer's output to the residual in fp32
  and normalises that *unrounded* sum; Megatron adds in the model dtype and normalises the
  rounded sum. Here the bias-dropout-add returns the fp32 sum (``kernels.fused_add_residual``),
  the norms read it, and the next add rounds it (so the hidden state between layers, and between
  pipeline stages, is fp32 under a bf16 model);
- logits stay in the model dtype (Megatron's patched LM head would return fp32); logprobs by the
  engine's sampler function over the real vocab.
Everything else (qkv and gate/up as one GEMM each, per-head QK-norm, SiLU-and-mul as torch ops,
the vocab-parallel embedding) is the same arithmetic in both, given the engine's GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...contract.refusals import refuse
from ...errors import ConfigError
from ...kernels.collectives import group_size
from . import kernels
from .expert_slices import moe_across_ranks
from .scoring import current_plan

_ready = {}
# Per model config (weakly): the RoPE base and max positions its GPTModel was built with.
_rope = WeakIdKeyDictionary()


def is_vllm(prof) -> bool:
    return prof is not None and prof.engine_name == "vllm"


def check_ready(prof) -> None:
    """At enable time: the engine the profile names is installed, and this CPU selects its kernels."""
    key = (prof.engine.version, prof.engine.cpu_isa)
    if key in _ready:
        return
    from .host import check_profile_isa
    from .refusals import require_vllm

    _ready[key] = (require_vllm(prof.engine.version), check_profile_isa(prof.engine.cpu_isa))


def set_rope(config, base: float, max_positions: int, llama3_factor: Optional[float] = None) -> None:
    """Recorded at GPTModel construction, for that model's config: the engine's RoPE cache is built
    from these (``llama3_factor``: GPTModel's rope_scaling_factor under rope_scaling)."""
    _rope[config] = (float(base), int(max_positions), None if llama3_factor is None else float(llama3_factor))


def rope_of(config):
    """(base, max positions, Llama-3 factor or None) of the model built with ``config``."""
    found = _rope.get(config)
    if found is None:
        raise ConfigError("vllm-cpu profile: this model was built before the patches were enabled (its RoPE base "
                          "is unknown); enable mindspeed-tp before building the model")
    return found


# ---------------------------------------------------------------- pieces the patches call

def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Column-parallel GEMM (merged qkv, gate_up, LM head): the engine's GEMM on this rank's output
    columns, in the model dtype (the engine's logits too); a bias (Qwen2's QKV bias: add_qkv_bias;
    add_bias_linear is refused before) its slice, added in the same engine call."""
    return kernels.engine_linear(x, weight, bias=bias)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, normalization: str) -> torch.Tensor:
    if normalization != "RMSNorm":
        raise refuse("vllm_model_shape", what=f"normalization={normalization!r}", engine="RMSNorm",
                     fix="use normalization=RMSNorm")
    return kernels.rms_norm(x, weight, eps)


def residual_add(x_with_bias, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    x, bias = x_with_bias
    if bias is not None:
        raise refuse("vllm_model_shape", what="a bias before the residual add (add_bias_linear)",
                     engine="no biases", fix="unset add_bias_linear")
    if training and prob > 0:
        raise refuse("vllm_model_shape", what="hidden_dropout > 0", engine="no dropout", fix="set hidden_dropout=0")
    return kernels.fused_add_residual(x, residual)


def rope(t: torch.Tensor, config, interleaved: bool, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RoPE on [s, b, heads, dim] at absolute positions 0..s-1 (the scored sequences start at 0), or at
    ``positions`` (s,) (a context-parallel rank's chunks)."""
    base, max_positions, llama3_factor = rope_of(config)
    s, b, h, d = t.shape
    x = t.reshape(s * b, h, d)
    if positions is None:
        positions = torch.arange(s, device=t.device)
    longest = int(positions.max()) + 1 if positions.numel() else s
    positions = positions.to(t.device).repeat_interleave(b)
    out = kernels.rotary(x, positions, base, max(max_positions, longest), neox=not interleaved,
                         llama3_factor=llama3_factor)
    return out.reshape(s, b, h, d)


def attention(query, key, value, scale: float, causal: bool, window: Optional[int] = None) -> torch.Tensor:
    """DotProductAttention: query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np*hn];
    ``window``: megatron-core's left window (its window_size (left, 0)), the engine's W = left + 1."""
    if not causal:
        raise refuse("vllm_model_shape", what="non-causal attention", engine="causal decoder attention",
                     fix="use attn_mask_type causal")
    sq, b, np_, hn = query.shape
    plan = current_plan(b)
    if max(plan.prompt_lens) > sq:
        raise ConfigError(f"engine_scoring: a prompt length exceeds the scored sequence length {sq}")
    out = kernels.attention(query.permute(1, 0, 2, 3), key.permute(1, 0, 2, 3), value.permute(1, 0, 2, 3),
                            plan, scale, -1 if window is None else int(window) + 1)
    return out.permute(1, 0, 2, 3).reshape(sq, b, np_ * hn)


def logprob_rows(full_vocab_logits: torch.Tensor) -> torch.Tensor:
    """Rows of full (padded) vocab logits -> the engine's fp32 logprobs over the real vocab, padded
    back with -inf columns (zero probability, so backward needs no special case)."""
    vocab = current_plan().vocab_size
    real = kernels.logprobs(full_vocab_logits[..., :vocab])
    pad = full_vocab_logits.shape[-1] - vocab
    if pad == 0:
        return real
    return torch.cat([real, real.new_full((*real.shape[:-1], pad), float("-inf"))], dim=-1)


# ---------------------------------------------------------------- MoE

_EXPERTS_ATTR = "_mindspeed_tp_vllm_experts"


def _local_experts(layer):
    """This rank's expert shards as (E/EP, 2I/ETP, H) gate|up and (E/EP, H, I/ETP) down
    (differentiable stacks; megatron's fc1 shard is its gate part then its up part)."""
    experts = layer.experts.local_experts
    return (torch.stack([e.linear_fc1.weight for e in experts]), torch.stack([e.linear_fc2.weight for e in experts]),
            [w for e in experts for w in (e.linear_fc1.weight, e.linear_fc2.weight)])


def _prepacked_all_experts(layer, prof, w13, w2, weights):
    """Without expert parallelism: every engine rank's slice of this rank's (all) experts, prepacked
    once per weight version (the engine holds them the same way)."""
    from .. import weight_caches

    key = weight_caches.key(weights)
    entry = getattr(layer, _EXPERTS_ATTR, None)
    if entry is None or not weight_caches.fresh(entry[0], entry[1], weights, key, "the engine's prepacked expert weights"):
        entry = (key, weight_caches.checksum(weights)) + kernels.prepack_experts(
            w13.detach(), w2.detach(), prof.rollout_tp, layer.config.moe_router_topk)
        setattr(layer, _EXPERTS_ATTR, entry)
    return entry[2], entry[3]


def moe_problems(model, prof) -> list:
    """What the profiles' MoE (the engine's Qwen3-MoE / Mixtral block) does not model, from a
    TransformerConfig or a model spec (the same field names): checked before an engine starts and
    again at each MoE layer."""
    problems = []
    if getattr(model, "moe_router_score_function", "softmax") != "softmax":
        problems.append("moe_router_score_function must be softmax (Qwen3-MoE, Mixtral)")
    if getattr(model, "moe_shared_expert_intermediate_size", None):
        problems.append("shared experts are not modelled (Qwen3-MoE and Mixtral have none)")
    if getattr(model, "moe_router_enable_expert_bias", False) or getattr(model, "moe_router_topk_scaling_factor", None):
        problems.append("expert bias / top-k scaling are not modelled")
    if getattr(model, "moe_router_group_topk", None):
        problems.append("group-limited routing (moe_router_num_groups / moe_router_group_topk) is not modelled")
    inter = model.moe_ffn_hidden_size or model.ffn_hidden_size
    if (inter // prof.rollout_tp) % kernels.MOE_ALIGNMENT or model.hidden_size % kernels.MOE_ALIGNMENT:
        problems.append(f"moe_ffn_hidden_size/rollout_tp={inter // prof.rollout_tp} and hidden_size="
                        f"{model.hidden_size} must be multiples of {kernels.MOE_ALIGNMENT} (else the engine pads)")
    return problems


def check_moe(layer, prof) -> None:
    config = layer.config
    problems = moe_problems(config, prof)
    if not getattr(config, "gated_linear_unit", False):
        problems.append("experts must be SwiGLU (gated_linear_unit=True)")
    if problems:
        raise refuse("vllm_moe", problems="; ".join(problems))


def moe(layer, hidden_states, prof, publish_routing) -> torch.Tensor:
    """MoELayer as the engine's Qwen3MoeSparseMoeBlock: router logits by the engine's GEMM (model
    dtype), its top-k router, its fused MoE kernel per engine rank's intermediate slice of every
    expert, the slices' outputs added as its all-reduce does. Under expert (tensor) parallelism the
    expert group's ranks split that work by slice (``expert_slices``); without it this rank runs every
    slice on its tokens."""
    check_moe(layer, prof)
    shape, dtype = hidden_states.shape, hidden_states.dtype
    h = hidden_states.reshape(-1, shape[-1])
    logits = kernels.engine_linear(h, layer.router.weight.to(dtype))
    topk_w, topk_ids = kernels.route(logits, layer.config.moe_router_topk,
                                     not bool(getattr(layer.config, "moe_router_pre_softmax", False)))
    publish_routing(layer, topk_ids.long())
    from megatron.core import parallel_state as ps

    w13, w2, weights = _local_experts(layer)
    add_dtype = torch.float32 if prof.rollout_allreduce_dtype == "float32" else dtype
    group = ps.get_expert_tensor_and_model_parallel_group()
    if group_size(group) > 1:  # the work cut by engine slice; no rank gathers every expert
        out = moe_across_ranks(h, topk_w, topk_ids, w13, w2, prof.rollout_tp, layer.config.moe_router_topk,
                               add_dtype, group, ps.get_expert_model_parallel_rank(),
                               ps.get_expert_tensor_parallel_rank())
    else:
        packed, isa = _prepacked_all_experts(layer, prof, w13, w2, weights)
        out = kernels.fused_moe(h, topk_w, topk_ids, w13, w2, packed, isa, add_dtype)
    return out.reshape(shape)
